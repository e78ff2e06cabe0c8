"""`specula check`: correct methods are certified, planted bugs are NOT lossless, and the check can fail.

Every sampled run is seeded, so each outcome is deterministic on a given machine. Margins: the
correct methods' combined p-values are far above alpha = 1e-3 and their power controls (distorted by the
0.1 TV the check plans for) far below it. The planted T > 0 bugs run with as few samples as keeps them clearly
rejected: the off-by-one residual has |z| > 20 with 150 samples per prompt, the hot draft about 6.6
with 200, the bonus from the draft about 6.5 with 400 (|z| > 3.5 rejects); the plan may add samples.
Typical acceptance, tests at the end: refused as lossy by construction, and rejected by the test itself when
the registry's flag is removed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2XS, STORIES

import specula
import specula.acceptance as acceptance
import specula.drafters.draft_model as draft_model
from specula.acceptance import Acceptor, accept_greedy
from specula.api import Speculator
from specula.certify.check import DEFAULT_PROMPTS
from specula.certify.distribution_test import chi2_sf, chi_square
from specula.certify.report import EXIT_CERTIFIED, EXIT_INCONCLUSIVE, EXIT_NOT_LOSSLESS, SCHEMA
from specula.cli import main
from specula.divergence import NEAR_TIE, REAL, classify, relative_tolerance
from specula.drafters.prompt_lookup import PromptLookupDrafter
from specula.drafters.vanilla import VanillaDrafter
from specula.runtime.target import Target
from specula.sampling import probabilities, sample

HEAD = Path(__file__).parent / "data" / "eagle-stories260k"
# Small greedy part (the T > 0 part keeps the check's defaults: 300 samples x 2 prompts x 4 tokens).
QUICK = {"n": 2, "max_new_tokens": 24}

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def speculators() -> dict[str, Speculator]:
    """One loaded speculator per method, shared by every test of the module (planted bugs patch functions)."""
    return {
        "sps": specula.load(STORIES, "sps", draft=LLAMA2XS, dtype="float32", profile=False),
        "pld": specula.load(STORIES, "pld", dtype="float32", profile=False),
        "eagle2": specula.load(STORIES, "eagle2", draft=HEAD, dtype="float32", profile=False),
    }


@pytest.fixture(scope="module")
def certified_reports(speculators) -> dict:
    return {}


def certified(speculators, reports: dict, method: str):
    if method not in reports:
        reports[method] = specula.check(speculator=speculators[method], **QUICK)
    return reports[method]


# ---------------------------------------------------------------- correct methods


@pytest.mark.parametrize("method", ["sps", "pld", "eagle2"])
def test_correct_method_is_certified_and_its_power_control_rejects(speculators, certified_reports, method):
    report = certified(speculators, certified_reports, method)
    assert report.verdict.startswith("certified lossless — "), report.table()
    assert report.exit_code == EXIT_CERTIFIED
    s = report.sampling
    # Non-vacuous: speculation really happened in both parts (pld accepts least: about 1 draft in 8 runs).
    assert report.greedy.accepted > 0 and s.accepted > s.method.samples // 20
    assert s.method.p_value >= s.alpha
    # The same test on the planted error (a known 0.1 TV distortion) rejects: the check could have failed.
    assert s.control.p_value < s.alpha and s.control_tv == pytest.approx(0.1, abs=1e-3), report.table()
    assert s.powered and s.detectable_tv <= s.target_tv == 0.1 and s.samples_per_prefix >= 300
    # T=0 on a row-invariant target: identical, not "within tolerance".
    assert report.greedy.row_invariant and report.greedy.identical == 2
    assert "2/2 identical" in report.verdict and "verify rows bit-equal" in report.table()


def test_json_report_follows_the_documented_schema(speculators, certified_reports):
    data = json.loads(json.dumps(certified(speculators, certified_reports, "sps").as_dict()))
    assert data["schema"] == SCHEMA == "specula.check/2" and data["status"] == "certified" and data["exit_code"] == 0
    assert data["verdict"].startswith("certified lossless — ") and data["lossy_by_construction"] is None
    assert {"target", "method", "draft", "dtype", "device", "seconds", "temperature"} <= set(data)
    greedy = data["greedy"]
    assert set(greedy) == {"prompts", "max_new_tokens", "identical", "compared_tokens", "drafted", "accepted",
                           "relative_tolerance", "row_invariant", "mismatched_probe_rows", "near_ties", "real",
                           "divergences"}
    # Row-invariant here: no near-tie allowance.
    assert greedy["prompts"] == 2 and greedy["row_invariant"] and greedy["relative_tolerance"] == 0.0
    sampling = data["sampling"]
    fit_keys = {"samples", "p_value", "likelihood_z", "p_likelihood", "chi2", "chi2_df", "p_chi2",
                "impossible_tokens"}
    assert set(sampling["method"]) == fit_keys
    assert set(sampling["control"]) == fit_keys | {"description", "factor", "tv"}
    assert set(sampling["power"]) == {"target_tv", "detectable_tv", "power", "max_samples"}
    assert sampling["power"]["detectable_tv"] <= sampling["power"]["target_tv"] == 0.1
    assert sampling["method"]["samples"] == sampling["prefixes"] * sampling["samples_per_prefix"] >= 600
    assert sampling["tokens"] == 4 and sampling["temperature"] == 1.0


# ---------------------------------------------------------------- planted bugs at T > 0


def test_off_by_one_residual_is_not_lossless(speculators, monkeypatch):
    # After a rejection the residual is shifted by one token id: an indexing bug in the residual.
    correct = acceptance.residual
    monkeypatch.setattr(acceptance, "residual", lambda p, q, x: torch.roll(correct(p, q, x), 1))
    for method in ("sps", "pld"):  # sampled drafts (max(0, p - q)) and point-mass drafts (p without x)
        report = specula.check(speculator=speculators[method], n=1, max_new_tokens=8, samples=150)
        assert report.status == "not_lossless" and report.exit_code == EXIT_NOT_LOSSLESS, report.table()
        assert report.verdict.startswith("NOT lossless: at T=1 the output is not distributed")


def test_draft_sampled_at_the_wrong_temperature_is_not_lossless(speculators, monkeypatch):
    # The sps draft draws its tokens at 1.5 T but hands the acceptor its distribution at T.
    def hot_sample(q, generator):
        hot = q ** (1 / 1.5)
        return sample(hot / hot.sum(), generator)

    monkeypatch.setattr(draft_model, "sample", hot_sample)
    report = specula.check(speculator=speculators["sps"], n=1, max_new_tokens=8, samples=200)
    assert report.exit_code == EXIT_NOT_LOSSLESS, report.table()
    assert report.sampling.method.p_value < report.sampling.alpha


def test_bonus_token_drawn_from_the_draft_is_not_lossless(speculators, monkeypatch):
    # After a fully accepted chain the bonus token comes from the draft model's next distribution,
    # not the target's: the drafter drafts one more step and the acceptor uses it.
    propose, accept = draft_model.DraftModelDrafter.propose, acceptance.accept_speculative

    def propose_with_next(self, context, max_depth, params, generator):
        tree = propose(self, context, max_depth, params, generator)
        if len(tree) > 1 and not params.greedy:
            tree.next_draft = probabilities(self._extend(tree.tokens[-1:]), params)
            self.seen = self.seen + [int(tree.tokens[-1])]
        return tree

    def accept_with_draft_bonus(tree, target_logits, params, generator):
        result = accept(tree, target_logits, params, generator)
        if hasattr(tree, "next_draft") and result.accepted_drafts == len(tree) - 1:
            result.next_token = sample(tree.next_draft, generator)
        return result

    monkeypatch.setattr(draft_model.DraftModelDrafter, "propose", propose_with_next)
    monkeypatch.setattr(acceptance, "accept_speculative", accept_with_draft_bonus)
    report = specula.check(speculator=speculators["sps"], n=1, max_new_tokens=8, samples=400)
    assert report.exit_code == EXIT_NOT_LOSSLESS, report.table()
    assert report.sampling.method.p_value < report.sampling.alpha


# ---------------------------------------------------------------- T = 0


def accept_first_child(tree, target_logits):
    """Bug: at T=0 every first-child draft is accepted whatever the target's argmax."""
    node, path = 0, [0]
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    return acceptance.Acceptance(path, int(torch.argmax(target_logits[node])))


def test_greedy_real_divergence_is_not_lossless(speculators, monkeypatch):
    monkeypatch.setattr(acceptance, "accept_greedy", accept_first_child)
    report = specula.check(speculator=speculators["pld"], temperature=0.0, **QUICK)
    assert report.exit_code == EXIT_NOT_LOSSLESS and report.sampling is None
    assert report.verdict.startswith("NOT lossless: ") and "real divergence" in report.verdict
    assert report.greedy.divergences and all(d.kind == REAL for _, d in report.greedy.divergences)
    _, first = report.greedy.divergences[0]
    assert first.gap > first.tolerance and first.margin > 0


class LastArgmaxAcceptor(Acceptor):
    """Greedy matching that breaks exact ties toward the higher token id (torch.argmax takes the lower)."""

    def __call__(self, tree, target_logits, params, generator):
        vocab = target_logits.shape[-1]
        best = vocab - 1 - torch.argmax(target_logits.flip(-1), dim=-1)
        return accept_greedy(tree, torch.nn.functional.one_hot(best, vocab).float())


def test_constructed_near_tie_is_explained_and_certified():
    # Give the last token the same output-embedding row as a token greedy decoding emits often: their
    # logits tie (up to the GEMM's rounding) wherever that token wins. Vanilla breaks the tie one way,
    # the method's acceptor the other way: the texts part, and the check must call it a near-tie.
    target = Target.load(STORIES, dtype="float32")
    vanilla = Speculator(target, "vanilla", VanillaDrafter())
    prompt = DEFAULT_PROMPTS[0]
    tokens = vanilla.generate(prompt, 24).token_ids[1:]
    frequent = max(set(tokens), key=tokens.count)
    weight = target.model.get_output_embeddings().weight
    with torch.no_grad():
        weight[target.vocab_size - 1] = weight[frequent]
    method = Speculator(target, "pld", PromptLookupDrafter(), acceptor=LastArgmaxAcceptor())
    report = specula.check(speculator=method, prompts=[prompt], n=1, max_new_tokens=24, temperature=0.0)
    assert report.greedy.divergences, report.table()
    for _, divergence in report.greedy.divergences:
        assert divergence.kind == NEAR_TIE and abs(divergence.gap) <= divergence.tolerance
        assert {divergence.vanilla_token, divergence.method_token} == {frequent, target.vocab_size - 1}
    assert report.verdict.startswith("certified lossless at T=0 — ") and report.exit_code == EXIT_CERTIFIED
    assert "near-tie" in report.table()


def test_classifier_uses_the_dtype_tolerance_on_the_logit_scale():
    logits = torch.tensor([10.0, 10.0 - 5e-4, 3.0, -20.0])
    # float32: 1e-4 x max|logit| = 2e-3, so a 5e-4 gap is a tie and a 1.0 gap is not.
    margin, gap, tolerance, kind = classify(logits, 0, 1, torch.float32)
    assert kind == NEAR_TIE and margin == pytest.approx(5e-4, rel=1e-3) and gap == margin
    assert tolerance == pytest.approx(relative_tolerance(torch.float32) * 20.0)
    assert classify(torch.tensor([10.0, 9.0, 0.0]), 0, 1, torch.float32)[3] == REAL
    # bfloat16 is coarser: 4 ulps (eps 2^-7) of the scale, so a gap of 0.5 at scale 20 is a tie there.
    assert relative_tolerance(torch.bfloat16) == pytest.approx(4 * 2 ** -7)
    assert classify(torch.tensor([20.0, 19.5, 0.0]), 0, 1, torch.bfloat16)[3] == NEAR_TIE
    assert classify(torch.tensor([20.0, 19.5, 0.0]), 0, 1, torch.float32)[3] == REAL
    # One output ending before the other is never a tie.
    assert classify(logits, 0, None, torch.float32)[3] == REAL


# ---------------------------------------------------------------- the check can fail to decide


def test_too_few_samples_are_inconclusive_not_certified(speculators):
    # Capped at 10 samples, the test cannot reach the 0.1 TV it must detect: inconclusive, whatever it saw.
    report = specula.check(speculator=speculators["pld"], samples=10, max_samples=10, prefixes=1, tokens=2, **QUICK)
    s = report.sampling
    assert s.samples_per_prefix == 10 and not s.powered and s.detectable_tv > s.target_tv
    assert report.status == "inconclusive" and report.exit_code == EXIT_INCONCLUSIVE
    assert report.verdict.startswith("inconclusive: with 10 samples per prompt (--max-samples 10) the test detects "
                                     f"only distortions >= {s.detectable_tv:.3g} TV, not the 0.1 asked for")
    assert "certified" not in report.verdict and f"detects distortions >= {s.detectable_tv:.3g} TV" in report.verdict


def test_an_undetected_control_is_inconclusive(speculators, monkeypatch):
    # A control whose distortion is too small to see (f = 1.0001) leaves the test unproven: never certified.
    import specula.certify.sampled as sampled

    monkeypatch.setattr(sampled, "control_factor", lambda rows_and_cells, tv: (1.0001, 1e-5))
    report = specula.check(speculator=speculators["pld"], samples=100, max_samples=100, prefixes=1, tokens=2,
                           tv=0.3, **QUICK)
    assert report.sampling.powered and report.sampling.control.p_value >= report.sampling.alpha, report.table()
    assert report.status == "inconclusive" and "the test did not detect the control" in report.verdict


def test_chi_square_pools_the_tail_and_matches_the_reference_distribution():
    from collections import Counter

    cells = {(0,): 0.5, (1,): 0.3}  # tail: 0.2
    counts = Counter({(0,): 50, (1,): 30, (2,): 12, (3,): 8})
    statistic, df = chi_square(counts, cells)
    assert df == 2 and statistic == pytest.approx(0.0)
    assert chi2_sf(11.345, 3) == pytest.approx(0.01, rel=1e-3)  # the chi-square table's 1% point for df 3


# ---------------------------------------------------------------- command line


def test_cli_json_exit_code_and_bad_input(tmp_path, capsys):
    assert main(["check", "--target", str(STORIES), "--method", "pld", "--dtype", "float32", "--n", "1",
                 "--max-new-tokens", "16", "--temperature", "0", "--no-profile", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"].startswith("certified lossless at T=0 — T=0: 1/1 identical; T>0: not tested")
    assert data["sampling"] is None and data["greedy"]["prompts"] == 1

    bad_file = tmp_path / "prompts.jsonl"
    bad_file.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    for argv in (["--method", "pld", "--top-p", "2"],               # bad sampling setting
                 ["--target", str(tmp_path), "--method", "pld"],     # not a model directory
                 ["--method", "pld", "--prompts", str(bad_file)],    # a record without a prompt
                 ["--method", "pld", "--samples", "5"],              # too few samples for any test
                 ["--method", "pld", "--tv", "0"],                   # no distortion to detect
                 ["--method", "sps"],                                # sps without --draft
                 ["--target", str(STORIES)]):                        # no --method
        argv = argv if "--target" in argv else ["--target", str(STORIES), *argv]
        assert main(["check", *argv, "--no-profile"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("specula: error: ") and err.count("\n") == 1, err


# ---------------------------------------------------------------- bench uses the same classifier


def test_bench_greedy_divergences_are_split_into_near_ties_and_real(speculators):
    from specula.bench.divergences import annotate_divergences
    from specula.bench.metrics import greedy_divergences
    from specula.bench.questions import Question

    target = speculators["pld"].target
    vanilla = Speculator(target, "vanilla", VanillaDrafter())
    question = Question(uid="q", dataset="d", category="c", turns=("Once upon a time",))
    expected = vanilla.generate(list(target.tokenizer(question.turns[0]).input_ids), 12).token_ids
    changed = expected[:5] + [(expected[5] + 1) % target.vocab_size] + expected[6:]

    def record(method, tokens):
        return {"question": "q", "method": method, "temperature": 0.0, "turns": [{"token_ids": tokens}]}

    records = [record("vanilla", expected), record("same", list(expected)), record("broken", changed)]
    annotate_divergences(records, target, {"q": question}, "vanilla", 400)
    assert records[1]["divergence"] is None and "divergence" not in records[0]
    found = records[2]["divergence"]
    assert found["turn"] == 0 and found["position"] == 5 and found["kind"] == REAL
    assert found["row_invariant"] and found["tolerance"] == 0.0  # probed: no near-tie allowance on this target
    assert greedy_divergences(records[1:]) == {"near_ties": 0, "real": 1}


def test_bench_report_says_identical_when_every_greedy_output_is_bit_equal():
    from test_bench import record

    from specula.bench.metrics import aggregate
    from specula.bench.report import markdown

    records = [record("a", "vanilla", 1.0, tokens=[1, 2, 3]),
               record("a", "pld", 2.0, tokens=[1, 2, 3], divergence=None),
               record("a", "sps", 2.0, tokens=[1, 2, 4], divergence={"kind": "real"})]
    settings = {"target": "t", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 8, "top_k": 0,
                "top_p": 1.0, "seed": 0, "data": ["q"], "methods": {}}
    text = markdown({"settings": settings, "records": records,
                     "aggregates": aggregate(records, ["vanilla", "pld", "sps"])})
    assert "| pld | 1 | 2.0 | – | 1.00 identical |" in text and "| vanilla | 1 | 1.0 | – | 1.00 |" in text
    assert "Greedy outputs of pld are identical to vanilla's, token for token, on every question." in text


def test_prompts_go_through_the_chat_template_when_the_tokenizer_has_one(speculators, tmp_path):
    from specula.certify.check import encode_prompt, read_prompts

    speculator = speculators["pld"]
    tokenizer = speculator.tokenizer
    raw = encode_prompt(speculator, "Hi there", 16).tolist()
    assert raw == tokenizer("Hi there").input_ids  # stories260k has no template: the raw text
    before = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}Assistant:{% endif %}")
    try:
        templated = encode_prompt(speculator, "Hi there", 16).tolist()
    finally:
        tokenizer.chat_template = before
    assert tokenizer.decode(templated, skip_special_tokens=True).strip() == "User: Hi there\nAssistant:"

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two", "id": 2}\n')
    assert read_prompts(path) == ["one", "two"]


# ---------------------------------------------------------------- typical acceptance: lossy, never certified

MEDUSA_HEAD = Path(specula.__file__).parent / "heads" / "bundled" / "medusa-stories260k"
POWER_STATEMENT = re.compile(r"T=1: detects distortions >= 0\.\d+ TV with power 0\.8 \(\d+ samples x 2 prompts\)")


@pytest.fixture(scope="module")
def typical():
    return specula.load(STORIES, "medusa", draft=MEDUSA_HEAD, dtype="float32", profile=False, acceptance="typical")


def test_typical_acceptance_is_lossy_by_construction_and_never_sampled(typical):
    report = specula.check(speculator=typical, n=1, max_new_tokens=8, temperature=1.0)
    assert report.status == "not_lossless" and report.exit_code == EXIT_NOT_LOSSLESS
    assert report.sampling is None and report.lossy == "typical acceptance"
    assert report.verdict.startswith("NOT lossless: typical acceptance is lossy by construction at T=1")
    assert "certified" not in report.verdict and "T=1: not sampled, lossy by construction" in report.verdict
    assert json.loads(json.dumps(report.as_dict()))["lossy_by_construction"] == "typical acceptance"
    # At T=0 typical acceptance is greedy matching: nothing lossy to say.
    greedy = specula.check(speculator=typical, temperature=0.0, **QUICK)
    assert greedy.status == "certified" and greedy.lossy is None


def test_typical_acceptance_without_its_flag_is_rejected_by_the_test(typical, monkeypatch):
    # Pretend the registry did not know: the distribution test itself must find typical acceptance's distortion.
    from specula.acceptance_typical import TypicalAcceptor

    monkeypatch.setattr(TypicalAcceptor, "lossless", True)
    report = specula.check(speculator=typical, n=1, max_new_tokens=8, temperature=1.0)
    s = report.sampling
    assert report.lossy is None and s is not None and s.powered and s.control.p_value < s.alpha
    assert report.status == "not_lossless" and s.method.p_value < s.alpha, report.table()
    assert report.verdict.startswith("NOT lossless: at T=1 the output is not distributed as the target's")
    assert POWER_STATEMENT.search(report.verdict), report.verdict


def test_every_sampled_verdict_states_the_distortion_it_detects(speculators, certified_reports):
    report = certified(speculators, certified_reports, "pld")
    assert POWER_STATEMENT.search(report.verdict), report.verdict
    assert f"any distortion >= {report.sampling.detectable_tv:.3g} TV" in report.table()


def test_cli_refuses_to_certify_typical_acceptance(capsys):
    code = main(["check", "--target", str(STORIES), "--method", "medusa", "--draft", str(MEDUSA_HEAD),
                 "--acceptance", "typical", "--temperature", "1", "--dtype", "float32", "--n", "1",
                 "--max-new-tokens", "8", "--no-profile"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_LOSSLESS and "verdict: NOT lossless: typical acceptance is lossy by construction" in out
    assert "certified" not in out


def test_greedy_part_says_where_the_verify_pass_is_not_row_invariant(speculators, monkeypatch):
    # Where the probe finds a verify row that differs from its one-token steps (e.g. a GPU without the invariant
    # kernels), divergences within the dtype's rounding are near-ties, and the report says that rule applied.
    import specula.divergence as divergence

    monkeypatch.setattr(divergence, "mismatched_rows", lambda target, tokens, *rest: [1])
    report = specula.check(speculator=speculators["pld"], temperature=0.0, **QUICK)
    assert not report.greedy.row_invariant and report.greedy.relative_tolerance == pytest.approx(1e-4)
    assert "verify rows NOT bit-equal to one-token steps here (probed: chain of 8 rows [1]" in report.table()
    assert "(verify rows not bit-equal here: near-ties allowed)" in report.verdict


def test_a_verify_block_that_is_not_row_invariant_overrules_a_probe_that_was(speculators, monkeypatch):
    """The probe runs blocks of up to 8 rows; on an H200 int8 passes were bit-equal there but not at 64 rows. When
    the divergence's own verify block, recomputed, differs from the one-token step, the report says so and judges
    the divergence as on a target without invariance (near-tie allowed), not as a real one."""
    import specula.divergence as divergence

    seen = []

    def explain(target, prompt, vanilla, method, verify_block=None, invariant=False):
        seen.append(invariant)
        position = divergence.first_difference(vanilla, method)
        if position is None:
            return None
        kind = divergence.REAL if invariant else divergence.NEAR_TIE  # a gap within rounding, not an exact tie
        return divergence.Divergence(position, vanilla[position], method[position], 0.01, 0.01,
                                     0.0 if invariant else 0.05, kind, verify_width=5, verify_argmax=method[position],
                                     shape_noise=0.02)

    speculator = speculators["pld"]
    generate = speculator.generate

    def one_token_changed(ids, max_new_tokens, *args, **kwargs):
        result = generate(ids, max_new_tokens, *args, **kwargs)
        result.token_ids[6] = (result.token_ids[6] + 1) % speculator.target.vocab_size
        return result

    monkeypatch.setattr(divergence, "explain", explain)
    monkeypatch.setattr(speculator, "generate", one_token_changed)
    report = specula.check(speculator=speculator, temperature=0.0, n=1, max_new_tokens=24)
    assert seen == [True, False]
    assert not report.greedy.row_invariant and "verify block of 5" in report.greedy.mismatched
    assert report.greedy.count(divergence.NEAR_TIE) == 1 and report.greedy.count(divergence.REAL) == 0
    assert report.status == "certified"
