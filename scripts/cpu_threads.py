"""How many torch threads should a step of SmolLM2 run on? Step times per thread count on this machine's CPU.

`specula.openmp` decodes on one passively waiting thread on machines of at most two CPUs (measured there: a second
thread, woken passively for each of a step's many small operations, costs more than it gives, and spinning threads
take the cores from each other as soon as anything else runs) and leaves larger machines to OpenMP's own waiting and
torch's thread count. This script measures both choices where there are more cores: a model of SmolLM2-135M's
shapes (30 layers, hidden 576, 9 query and 3 key-value heads of 64, MLP 1,536, tied vocabulary of 49,152) with
random weights, loaded in ``--weights`` (default q4_1, eager), after a prompt of ``--prompt-length`` tokens; for
each thread count in ``--threads`` the median time of a one-token step (vanilla decoding's) and of a
``--block``-token verify step (a speculative method's), in ``--rounds`` rounds (ascending, then descending thread
counts, and so on). Weights do not change a step's time, so random ones stand in for the GGUF (too large to copy to
a lent machine). The waiting policy is the process's, so run it once per policy:

    OMP_WAIT_POLICY=PASSIVE python scripts/cpu_threads.py --model runs/smollm2-shaped --out runs/threads-passive.json
    GOMP_SPINCOUNT=300000 python scripts/cpu_threads.py --model runs/smollm2-shaped --out runs/threads-spin.json

The model folder is made (random weights, ``--tokenizer-from``'s tokenizer) when it does not exist.
"""

# ruff: noqa: I001  (specula is imported before torch on purpose, below)
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

# specula before torch, as the CLI imports them: specula sets OpenMP's waiting policy before torch's runtime reads it
from specula.openmp import default_threads
import torch

from specula.runtime.target import Target

ROOT = Path(__file__).resolve().parent.parent


def save_random_llama(directory: Path, tokenizer_from: Path, **config) -> Path:
    """A Llama of random weights (seed 0) with ``config`` (`LlamaConfig`'s arguments), saved to ``directory`` with
    ``tokenizer_from``'s tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(directory)
    for name in tokenizer_from.iterdir():
        if "token" in name.name:
            shutil.copy(name, directory / name.name)
    return directory


def smollm2_shaped(directory: Path, tokenizer_from: Path) -> Path:
    """A Llama of SmolLM2-135M's shapes with random weights (float32 safetensors, ~540 MB)."""
    return save_random_llama(directory, tokenizer_from, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                             tie_word_embeddings=True)


def step_ms(target: Target, tokens: torch.Tensor, repeats: int) -> float:
    """Median ms of ``repeats`` forwards of ``tokens`` [n] after the committed prefix (each one discarded)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        target.forward(tokens).logits.argmax()
        times.append(time.perf_counter() - t0)
        target.commit([])
    return round(sorted(times)[len(times) // 2] * 1000, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="model folder (made with random weights if missing)")
    p.add_argument("--tokenizer-from", type=Path, default=ROOT.parent / "shared/models/stories260k")
    p.add_argument("--weights", default="q4_1")
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--block", type=int, default=10, help="tokens of the verify step timed beside the one-token step")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2, help="passes over the thread counts, alternately up and down")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not args.model.exists():
        smollm2_shaped(args.model, args.tokenizer_from)
    t0 = time.perf_counter()
    target = Target.load(args.model, dtype="float32", weights=args.weights)
    load_s = time.perf_counter() - t0
    generator = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(3, 500, (args.prompt_length,), generator=generator))
    one, block = torch.tensor([7]), torch.randint(3, 500, (args.block,), generator=generator)
    counts = [int(n) for n in args.threads.split(",") if int(n) <= (os.cpu_count() or 1)]
    rows = []
    for round_ in range(1, args.rounds + 1):
        for n in counts if round_ % 2 else counts[::-1]:
            torch.set_num_threads(n)
            step_ms(target, one, 5)  # wake the pool at this size
            rows.append({"round": round_, "threads": n, "one_token_ms": step_ms(target, one, args.repeats),
                         f"{args.block}_token_ms": step_ms(target, block, args.repeats // 2)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "default_threads": default_threads(),
              "weights": args.weights, "prompt_length": args.prompt_length, "load_s": round(load_s, 1),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
