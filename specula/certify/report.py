"""What `specula check` found: the verdict, a text table and a JSON form.

Every verdict states what the test could detect: after " — ", the T = 0 count of identical outputs and, at
T > 0, the least distortion (total variation over the test's cells) detected with power 0.8 and the control's
(`specula.certify.power`), or why T > 0 was not sampled.

JSON schema (``CheckReport.as_dict``, version ``specula.check/2``)::

    {
      "schema": "specula.check/2",
      "verdict": "certified lossless — <power>" | "NOT lossless: <reasons> — <power>"
                 | "inconclusive: <reasons> — <power>",
      "status": "certified" | "not_lossless" | "inconclusive",
      "exit_code": 0 | 1 | 3,
      "target": str, "method": str, "draft": str | null, "dtype": str, "device": str,
      "seconds": float, "temperature": float,
      "lossy_by_construction": str | null,  # e.g. "typical acceptance": NOT lossless at T > 0, not sampled
      "greedy": {                       # T = 0: the method against vanilla, token for token
        "prompts": int, "max_new_tokens": int,
        "identical": int,               # prompts whose new tokens equal vanilla's
        "compared_tokens": int,         # tokens compared (each prompt up to its first divergence)
        "drafted": int, "accepted": int,  # the method's draft tokens over the T = 0 runs
        "row_invariant": bool,          # the verify pass gave the probe's rows the bits of one-token steps
        "mismatched_probe_rows": {block: [row, ...]},  # where it did not ({} when row_invariant)
        "relative_tolerance": float,    # near-tie threshold as a fraction of max|logit| (0 when row_invariant)
        "near_ties": int, "real": int,
        "divergences": [{"prompt": int, "position": int, "vanilla_token": int | null,
                         "method_token": int | null, "margin": float, "gap": float | null,
                         "tolerance": float, "kind": "near-tie" | "real",
                         "verify_width": int | null, "verify_argmax": int | null, "shape_noise": float | null,
                         "vanilla_text": str | null, "method_text": str | null}]
      },
      "sampling": null | {              # T > 0: distribution test (null at temperature 0 or when lossy)
        "temperature": float, "top_p": float, "top_k": int, "alpha": float,
        "prefixes": int, "samples_per_prefix": int, "tokens": int,
        "drafted": int, "accepted": int,  # the method's draft tokens over the sampled runs
        "power": {"target_tv": float, "detectable_tv": float, "power": float, "max_samples": int},
        "method":  {"samples": int, "p_value": float, "likelihood_z": float, "p_likelihood": float,
                    "chi2": float, "chi2_df": int, "p_chi2": float | null, "impossible_tokens": int},
        "control": {"description": str, "factor": float, "tv": float, ...the same fields}  # must be rejected
      }
    }

Exit codes: 0 certified, 1 NOT lossless, 3 inconclusive (2 is bad input, raised as SpeculaError).
"""

from __future__ import annotations

from dataclasses import dataclass

from specula.certify.distribution_test import FitResult
from specula.certify.sampled import SamplingResult
from specula.divergence import NEAR_TIE, REAL, GreedyResult

SCHEMA = "specula.check/2"
EXIT_CERTIFIED, EXIT_NOT_LOSSLESS, EXIT_INCONCLUSIVE = 0, 1, 3
STATUS_EXIT = {"certified": EXIT_CERTIFIED, "not_lossless": EXIT_NOT_LOSSLESS, "inconclusive": EXIT_INCONCLUSIVE}


@dataclass
class CheckReport:
    target: str
    method: str
    draft: str | None
    dtype: str
    device: str
    greedy: GreedyResult
    sampling: SamplingResult | None
    seconds: float = 0.0
    lossy: str | None = None  # the acceptance rule the registry marks lossy (then T > 0 is not sampled)
    temperature: float = 0.0

    @property
    def problems(self) -> list[str]:
        """Findings that make the method NOT lossless."""
        found = []
        real = [(i, d) for i, d in self.greedy.divergences if d.kind == REAL]
        if real:
            where = ", ".join(f"prompt {i} token {d.position}" for i, d in real[:3])
            where += ", ..." if len(real) > 3 else ""
            found.append(f"{len(real)} real divergence(s) from vanilla at T=0 ({where})")
        if self.lossy:
            found.append(f"{self.lossy} is lossy by construction at T={self.temperature:g} (the registry marks "
                         "its acceptor lossy: it accepts plausible tokens, not each with the target's probability)")
        s = self.sampling
        if s is not None and s.method.p_value < s.alpha:
            impossible = (f", {s.method.impossible} token(s) the target never samples"
                          if s.method.impossible else "")
            found.append(f"at T={s.temperature:g} the output is not distributed as the target's "
                         f"(p = {s.method.p_value:.2g} < {s.alpha:g}{impossible})")
        return found

    @property
    def doubts(self) -> list[str]:
        """Reasons the check could not certify a method it did not find at fault."""
        found = []
        if self.method != "vanilla" and self.greedy.accepted == 0:
            found.append("no draft token was accepted at T=0, so greedy equality tested no speculation")
        s = self.sampling
        if s is not None:
            if not s.powered:
                found.append(f"with {s.samples_per_prefix} samples per prompt (--max-samples {s.max_samples}) the "
                             f"test detects only distortions >= {s.detectable_tv:.3g} TV, not the {s.target_tv:g} "
                             "asked for; raise --max-samples or --tv")
            if s.control.p_value >= s.alpha:
                found.append(f"the test did not detect the control, distorted by {s.control_tv:.3g} TV "
                             f"(p = {s.control.p_value:.2g} >= {s.alpha:g}); raise --samples")
            if self.method != "vanilla" and s.drafted == 0:
                found.append(f"no draft token was proposed in the T={s.temperature:g} runs")
        return found

    @property
    def status(self) -> str:
        return "not_lossless" if self.problems else "inconclusive" if self.doubts else "certified"

    @property
    def power(self) -> str:
        """What the check could detect, part by part (the verdict's tail)."""
        g = self.greedy
        greedy = f"T=0: {g.identical}/{g.prompts} identical"
        if g.divergences:
            greedy += f", {_count(g.count(NEAR_TIE), 'near-tie')}, {g.count(REAL)} real"
        if not g.row_invariant:
            greedy += " (verify rows not bit-equal here: near-ties allowed)"
        s = self.sampling
        if self.lossy:
            sampled = f"T={self.temperature:g}: not sampled, lossy by construction"
        elif s is None:
            sampled = "T>0: not tested"
        else:
            sampled = (f"T={s.temperature:g}: detects distortions >= {s.detectable_tv:.3g} TV with power "
                       f"{s.power:g} ({s.samples_per_prefix} samples x {_count(s.prefixes, 'prompt')}), control at "
                       f"{s.control_tv:.3g} TV {'rejected' if s.control.p_value < s.alpha else 'NOT rejected'} "
                       f"(p {_p(s.control.p_value)})")
        return f"{greedy}; {sampled}"

    @property
    def verdict(self) -> str:
        if self.problems:
            found = "NOT lossless: " + "; ".join(self.problems)
        elif self.doubts:
            found = "inconclusive: " + "; ".join(self.doubts)
        else:
            found = "certified lossless" + (" at T=0" if self.sampling is None else "")
        return f"{found} — {self.power}"

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT[self.status]

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "verdict": self.verdict, "status": self.status, "exit_code": self.exit_code,
                "target": self.target, "method": self.method, "draft": self.draft, "dtype": self.dtype,
                "device": self.device, "seconds": round(self.seconds, 2), "temperature": self.temperature,
                "lossy_by_construction": self.lossy, "greedy": self.greedy.as_dict(),
                "sampling": None if self.sampling is None else self.sampling.as_dict()}

    def table(self) -> str:
        """The human-readable report: one block per part, the verdict last."""
        draft = f" (draft {self.draft})" if self.draft else ""
        lines = [f"specula check: target {self.target}, method {self.method}{draft}, {self.dtype}, {self.device}", ""]
        lines += _greedy_lines(self.greedy, self.dtype)
        s = self.sampling
        if self.lossy:
            lines += ["", f"T={self.temperature:g}  not sampled: {self.lossy} is lossy by construction (the registry "
                          "marks it so); its output is not the target's distribution at T > 0"]
        elif s is None:
            lines += ["", "T>0  not tested (temperature 0)"]
        else:
            lines += [""] + _sampling_lines(s)
        lines += ["", f"verdict: {self.verdict}  ({self.seconds:.1f} s)"]
        return "\n".join(lines)


def _greedy_lines(g: GreedyResult, dtype: str) -> list[str]:
    lines = [f"T=0  {_count(g.prompts, 'prompt')} x {g.max_new_tokens} new tokens against vanilla: "
             f"{g.identical}/{g.prompts} identical"
             + (f", {_count(g.count(NEAR_TIE), 'near-tie')}, {_count(g.count(REAL), 'real divergence')}"
                if g.divergences else "")
             + f"; {g.accepted}/{g.drafted} drafts accepted"]
    if g.row_invariant:
        lines.append("     verify rows bit-equal to one-token steps here (probed): outputs must be identical, "
                     "any divergence is real (exact ties excepted)")
    else:
        where = ", ".join(f"{block} rows {rows}" for block, rows in g.mismatched.items())
        lines.append(f"     verify rows NOT bit-equal to one-token steps here (probed: {where}): a divergence "
                     f"within {g.relative_tolerance:.1e} x max|logit| ({dtype}) is a near-tie")
    if g.divergences:
        lines.append(f"     {'prompt':>6} {'token':>5} {'vanilla':>14} {'method':>14} {'top-2 margin':>12} "
                     f"{'gap':>10} {'tolerance':>10} {'verify argmax':>13}  kind")
        for i, d in g.divergences:
            gap = "-" if d.gap == float("inf") else f"{d.gap:.3g}"
            verify = "-" if d.verify_argmax is None else f"{d.verify_argmax} (k={d.verify_width})"
            lines.append(f"     {i:>6} {d.position:>5} {_tok(d.vanilla_token, d.vanilla_text):>14} "
                         f"{_tok(d.method_token, d.method_text):>14} {d.margin:>12.3g} {gap:>10} "
                         f"{d.tolerance:>10.3g} {verify:>13}  {d.kind}")
    return lines


def _sampling_lines(s: SamplingResult) -> list[str]:
    filters = "".join([f", top-p {s.top_p:g}" if s.top_p < 1 else "", f", top-k {s.top_k}" if s.top_k else ""])
    m, c = s.method, s.control
    return [f"T={s.temperature:g}{filters}  {_count(s.prefixes, 'prompt')} x {s.samples_per_prefix} "
            f"samples of the first {s.tokens} tokens through the method's loop; "
            f"{s.accepted}/{s.drafted} drafts accepted",
            f"     power: {s.samples_per_prefix} samples per prompt, planned for {s.target_tv:g} TV (at most "
            f"{s.max_samples}): any distortion >= {s.detectable_tv:.3g} TV over the test's cells is detected with "
            f"probability >= {s.power:g}",
            f"     {'test':<24} {'method':>22} {'control':>22}",
            f"     {'likelihood z':<24} {_p(m.p_likelihood) + f' (z {m.z:+.2f})':>22} "
            f"{_p(c.p_likelihood) + f' (z {c.z:+.2f})':>22}",
            f"     {'pooled chi-square':<24} {_chi(m):>22} {_chi(c):>22}",
            f"     {'p (Bonferroni)':<24} {_p(m.p_value):>22} {_p(c.p_value):>22}   alpha {s.alpha:g}",
            f"     control: {s.control_description}, distorted by {s.control_tv:.3g} TV; "
            "it must be rejected (p < alpha) for the test to count"]


def _tok(token: int | None, text: str | None = None) -> str:
    if token is None:
        return "end"
    return str(token) if text is None else f"{token} {text[:6]!r}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def _chi(fit: FitResult) -> str:
    if fit.p_chi2 is None:
        return "- (no cells)"
    return f"{_p(fit.p_chi2)} (df {fit.df})"
