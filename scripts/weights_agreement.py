"""Top-1 agreement of each weight format with the float32 model: argmax tokens compared position by position.

Texts: the first turns of MT-bench questions through the chat template, each followed by the float32
model's own greedy answer; every format is run teacher-forced over the same tokens, and its argmax at
every answer position is compared with the float32 model's. A disagreement where the float32 model's
own top-2 margin was small is a near-tie of the model (not of floating point); the table counts them
under a few margins. For a target converted from a GGUF file, float32 *is* the file's dequantized
model, so int4 with the file's blocks should agree almost everywhere.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/weights_agreement.py --questions 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from time_weights import QUESTIONS, load_variant  # noqa: E402

from specula.bench.agreement import Agreement, argmax_agreement  # noqa: E402
from specula.runtime.model_source import DEFAULT_MODEL  # noqa: E402

DEFAULT_VARIANTS = ("bfloat16", "int8", "int4", "q4_1", "int4-requant", "int8+head", "int4+head", "int4@float32",
                    "int4-requant@float32")
MARGINS = (0.1, 0.5, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_MODEL)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import specula

    reference = specula.load(args.target, weights="float32")
    questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text(encoding="utf-8").splitlines()]
    texts = []  # (tokens [P + A], P)
    for question in questions[:args.questions]:
        prompt = reference.encode(question)  # as a user message through the chat template
        answer = reference.generate(prompt, max_new_tokens=args.answer_tokens).token_ids
        texts.append((torch.cat([prompt, torch.tensor(answer, dtype=prompt.dtype)]), len(prompt)))
    with torch.inference_mode():
        reference_logits = [reference.target.prefill(ids).logits[start - 1:-1].float() for ids, start in texts]
    print(f"{sum(len(ids) - start for ids, start in texts)} answer positions over {len(texts)} questions; "
          f"disagreements where float32's own top-2 margin is below {', '.join(map(str, MARGINS))} logits")
    print(f"{'variant':<22}{'agreement':>10}{'disagree':>10}" + "".join(f"{f'<{m}':>8}" for m in MARGINS))
    for variant in args.variants.split(","):
        target = load_variant(args.target, variant)
        print(f"{'':<22}{target.weights_report.summary()}", file=sys.stderr)
        total = Agreement(0, 0, [])
        with torch.inference_mode():
            for (ids, start), ref in zip(texts, reference_logits, strict=True):
                total = total.add(argmax_agreement(ref, target.prefill(ids).logits[start - 1:-1]))
        disagreements = total.positions - total.agreeing
        print(f"{variant:<22}{total.rate:>10.4f}{disagreements:>10}"
              + "".join(f"{total.near_ties(m):>8}" for m in MARGINS))
        del target


if __name__ == "__main__":
    main()
