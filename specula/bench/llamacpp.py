"""llama.cpp rows of `specula bench`: the target's GGUF decoded by ``llama-server``, as a CPU user would run it.

Methods (`specula.bench.llamacpp_options.LLAMACPP_METHODS`):

- ``llamacpp``: plain decoding.
- ``llamacpp-draft``: llama.cpp's own speculative decoding with ``draft`` (``-md``):
  ``spec_type = "draft-simple"`` (default; a draft model with the target's vocabulary, a GGUF
  file or a Hugging Face Llama directory) or ``"draft-eagle3"`` (an EAGLE-3 head: an eagle3
  GGUF, or a head directory exported with `specula.gguf.heads.export_eagle3_gguf`);
  ``draft_max``/``draft_min``/``draft_p_min``/``draft_sampling`` become
  ``--spec-draft-n-max``/``-n-min``/``-p-min``/``--spec-draft-sampling``.

What makes a row comparable with ours: the same GGUF (a target given as a Hugging Face
directory is written as an F32 GGUF by `specula.gguf.target`), the bench's thread count
(``-t``/``-tb``) and the target's context (``-c``), one slot, no prompt cache (``--cache-ram 0``,
``cache_prompt: false``: every turn is prefilled in full, as ours are), and each prompt sent
to ``/completion`` as the very token ids our rows get (rendered by our chat template; no
second tokenizer involved). Sampling: temperature, then top-k, then top-p — `transformers`'
order, which `specula.sampling` follows — and nothing else (min-p and the penalties off); at
temperature 0 llama.cpp's temperature sampler keeps only the argmax: greedy. Token ids come
back with ``return_tokens``.

Timing: a turn's ``wall_time`` is llama.cpp's own ``prompt_ms + predicted_ms`` (prefill and
decoding, the span our rows time, without HTTP and JSON); each turn also keeps the server's
timings and the client-side wall time under ``llamacpp``. τ comes from the draft counters:
cycles = predicted tokens − accepted draft tokens.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from specula.bench.config import MethodSpec
from specula.bench.llama_server import LlamaServer, find_llama_server, server_version
from specula.bench.llamacpp_options import DRAFT_OPTIONS
from specula.bench.runners import TurnResult
from specula.errors import SpeculaError
from specula.gguf.heads import export_eagle3_gguf
from specula.gguf.target import export_llama_gguf
from specula.runtime.model_source import gguf_source, resolve_model
from specula.sampling import SamplingParams

# ---------------------------------------------------------------- the request and the answer


def completion_request(prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int) -> dict:
    """The /completion body for one turn: our token ids, our sampling, nothing cached, token ids back."""
    return {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(max_new_tokens),
        "temperature": 0.0 if params.greedy else float(params.temperature),
        "top_k": int(params.top_k),  # 0 = off, in llama.cpp as in ours
        "top_p": float(params.top_p),
        "min_p": 0.0,
        "samplers": ["temperature", "top_k", "top_p"],  # transformers' order; temperature 0 keeps the argmax
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
        "seed": int(seed),
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "n_probs": 0,
    }


def parse_completion(answer: dict, eos_ids: set[int], client_wall: float) -> TurnResult:
    """A `TurnResult` from a /completion answer: the token ids, llama.cpp's timings, τ's cycles."""
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise SpeculaError("llama-server returned no token ids (the 'tokens' field of /completion with "
                           "return_tokens): this build is too old for the llama.cpp rows")
    timings = answer.get("timings")
    if not isinstance(timings, dict) or "predicted_ms" not in timings or "prompt_ms" not in timings:
        raise SpeculaError("llama-server returned no timings with its completion")
    predicted_n = int(timings.get("predicted_n", len(tokens)))
    accepted = int(timings.get("draft_n_accepted", 0))
    stop_type = answer.get("stop_type")
    if stop_type == "eos" or (tokens and tokens[-1] in eos_ids):
        stop = "eos"
    elif stop_type == "limit":
        stop = "max_new_tokens"
    else:
        stop = str(stop_type or "")
    server_ms = float(timings["prompt_ms"]) + float(timings["predicted_ms"])
    kept = {k: timings[k] for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                                    "draft_n", "draft_n_accepted") if k in timings}
    kept["client_wall_time"] = client_wall
    return TurnResult(list(tokens), server_ms / 1000.0, cycles=max(predicted_n - accepted, 1) if tokens else None,
                      stop_reason=stop, extra={"llamacpp": kept})


def summarize_turns(turns: list[dict]) -> dict | None:
    """Per record: llama.cpp's own decode rate (predicted tokens over predicted time), client wall time, drafts."""
    mine = [t["llamacpp"] for t in turns if isinstance(t.get("llamacpp"), dict)]
    if not mine:
        return None
    predicted_n = sum(int(t.get("predicted_n", 0)) for t in mine)
    predicted_ms = sum(float(t.get("predicted_ms", 0.0)) for t in mine)
    out = {"predicted_n": predicted_n, "predicted_ms": predicted_ms,
           "decode_tokens_per_s": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else None,
           "prompt_ms": sum(float(t.get("prompt_ms", 0.0)) for t in mine),
           "client_wall_time": sum(float(t.get("client_wall_time", 0.0)) for t in mine)}
    if any("draft_n" in t for t in mine):
        out["draft_n"] = sum(int(t.get("draft_n", 0)) for t in mine)
        out["draft_n_accepted"] = sum(int(t.get("draft_n_accepted", 0)) for t in mine)
    return out


# ---------------------------------------------------------------- models as GGUF files


def target_gguf(target: str, workdir: Path) -> Path:
    """The GGUF file llama.cpp runs for ``target``: the target's own, or a Llama directory written as F32 GGUF."""
    found = gguf_source(target)
    if found is not None:
        return Path(found)
    return export_llama_gguf(resolve_model(target, "target"), workdir / "target.gguf")


def draft_gguf(draft: str, spec_type: str, target_file: Path, workdir: Path) -> Path:
    """The GGUF for ``-md``: a .gguf as it is; a Llama directory, or (draft-eagle3) an EAGLE-3 head, exported."""
    path = Path(draft).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir():
        raise SpeculaError(f"draft {draft} is neither a .gguf file nor a directory")
    if spec_type == "draft-eagle3":
        return export_eagle3_gguf(path, target_file, workdir / "draft-eagle3.gguf")

    return export_llama_gguf(path, workdir / "draft.gguf")


def server_args(model: Path, threads: int, context: int, draft: Path | None = None,
                options: dict | None = None) -> list[str]:
    """llama-server's command-line arguments (without --host/--port) for one bench row."""
    args = ["-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1",
            "--no-webui", "--cache-ram", "0", "--no-cache-prompt", "--no-context-shift"]
    if draft is not None:
        options = dict(options or {})
        args += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        args += ["--spec-type", options.pop("spec_type", "draft-simple")]
        for key, value in sorted(options.items()):
            args += [DRAFT_OPTIONS[key][1], str(value)]
    return args


class LlamaCppRunner:
    """One llama.cpp row: a running llama-server and the bench's `run` interface; `close` stops the server."""

    draft_model = None  # llama.cpp's draft lives in the server, not in the bench's context budget

    def __init__(self, spec: MethodSpec, target, binary: str | Path | None, target_spec: str, threads: int,
                 server_factory=LlamaServer):
        self.spec = spec
        self.eos_ids = set(getattr(target, "eos_token_ids", ()) or ())
        self.binary = find_llama_server(binary)
        self.version = server_version(self.binary)
        self._workdir = tempfile.TemporaryDirectory(prefix="specula-llamacpp-")
        try:
            workdir = Path(self._workdir.name)
            model = target_gguf(target_spec, workdir)
            draft = None
            if spec.method == "llamacpp-draft":
                draft = draft_gguf(spec.draft, spec.options.get("spec_type", "draft-simple"), model, workdir)
            args = server_args(model, threads, int(target.max_length), draft, spec.options)
            self.server = server_factory(self.binary, args)
            self.server.__enter__()
        except BaseException:
            self._workdir.cleanup()
            raise

    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int) -> TurnResult:
        body = completion_request(prompt_ids, max_new_tokens, params, seed)
        start = time.perf_counter()
        answer = self.server.post("/completion", body)
        return parse_completion(answer, self.eos_ids, time.perf_counter() - start)

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self._workdir.cleanup()


def server_table(records: list[dict]) -> dict:
    """{temperature: {method: llama.cpp's own numbers over its records}} for the report and the command's summary.

    decode_tokens_per_s is predicted tokens over llama.cpp's decoding time (prefill excluded);
    client_tokens_per_s the mean per question of new tokens over the wall time the bench saw
    around its HTTP requests; acceptance the share of drafted tokens llama.cpp accepted.
    """
    out: dict[str, dict] = {}
    for record in records:
        server = record.get("llamacpp")
        if not isinstance(server, dict):
            continue
        row = out.setdefault(f"{float(record['temperature']):g}", {}).setdefault(
            record["method"], {"questions": 0, "predicted_n": 0, "predicted_ms": 0.0, "client_rates": [],
                               "draft_n": 0, "draft_n_accepted": 0})
        row["questions"] += 1
        row["predicted_n"] += int(server.get("predicted_n", 0))
        row["predicted_ms"] += float(server.get("predicted_ms", 0.0))
        if server.get("client_wall_time"):
            row["client_rates"].append(record["new_tokens"] / server["client_wall_time"])
        row["draft_n"] += int(server.get("draft_n", 0))
        row["draft_n_accepted"] += int(server.get("draft_n_accepted", 0))
    for table in out.values():
        for row in table.values():
            rates = row.pop("client_rates")
            row["decode_tokens_per_s"] = (1000.0 * row["predicted_n"] / row["predicted_ms"]
                                          if row["predicted_ms"] > 0 else None)
            row["client_tokens_per_s"] = sum(rates) / len(rates) if rates else None
            row["draft_acceptance"] = row["draft_n_accepted"] / row["draft_n"] if row["draft_n"] else None
    return out
