"""Build an answer corpus (`specula.drafters.answer_corpus`) from a head-training capture (`specula train data`).

Every sample's response (its loss-masked tokens: what the target itself wrote), with the ``--context`` tokens
before it (the chat template's opening of the assistant turn, so that the answer's first words can be matched),
in the capture's journal order, ``--max-tokens`` tokens at most. The capture's tokenizer fingerprint goes into the
file, so that a target with another tokenizer never drafts from it:

    python scripts/build_answer_corpus.py --data /path/to/capture \\
        --out specula/heads/bundled/answers-smollm2-135m/answers.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specula.drafters.answer_corpus import AnswerCorpus
from specula.runtime.target import FeatureRequest
from specula.training.generated import GeneratedData


def responses(data: GeneratedData, context: int, max_tokens: int) -> list[list[int]]:
    """The capture's responses as token lists (``context`` tokens before each), in journal order."""
    texts, total = [], 0
    for index in range(len(data)):
        sample = data[index]
        answer = sample["loss_mask"].nonzero().flatten()
        if len(answer) == 0:
            continue
        text = sample["input_ids"][max(0, int(answer[0]) - context):int(answer[-1]) + 1].tolist()
        texts.append(text[:max_tokens - total])
        total += len(texts[-1])
        if total >= max_tokens:
            break
    return texts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="a `specula train data` output directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context", type=int, default=8, help="tokens kept before each response (default: 8)")
    p.add_argument("--max-tokens", type=int, default=2_000_000)
    p.add_argument("--depth", type=int, default=16, help="phrase + continuation tokens indexed (default: 16)")
    args = p.parse_args()
    data = GeneratedData(args.data, FeatureRequest())  # ids and loss masks only: no features read
    texts = responses(data, args.context, args.max_tokens)
    corpus = AnswerCorpus.from_texts(texts, args.depth, data.run["components"]["tokenizer"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    corpus.save(args.out)
    print(f"{args.out}: {len(texts)} answers, {sum(map(len, texts))} tokens, "
          f"{args.out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
