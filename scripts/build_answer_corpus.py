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
import json
from pathlib import Path

from safetensors import safe_open

from specula.drafters.answer_corpus import AnswerCorpus


def responses(capture: Path, context: int, max_tokens: int) -> list[list[int]]:
    """The capture's responses as token lists (``context`` tokens before each), in journal order."""
    texts, total = [], 0
    for line in (capture / "journal.jsonl").read_text().splitlines():
        with safe_open(capture / "shards" / json.loads(line)["file"], "pt") as shard:
            ids, mask, offsets = (shard.get_tensor(name) for name in ("input_ids", "loss_mask", "offsets"))
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            answer = mask[start:end].nonzero().flatten()
            if len(answer) == 0:
                continue
            text = ids[max(start, start + int(answer[0]) - context):start + int(answer[-1]) + 1].tolist()
            texts.append(text[:max_tokens - total])
            total += len(texts[-1])
            if total >= max_tokens:
                return texts
    return texts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="a `specula train data` output directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context", type=int, default=8, help="tokens kept before each response (default: 8)")
    p.add_argument("--max-tokens", type=int, default=2_000_000)
    p.add_argument("--depth", type=int, default=16, help="phrase + continuation tokens indexed (default: 16)")
    args = p.parse_args()
    run = json.loads((args.data / "run.json").read_text())
    texts = responses(args.data, args.context, args.max_tokens)
    corpus = AnswerCorpus.from_texts(texts, args.depth, run["components"]["tokenizer"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    corpus.save(args.out)
    print(f"{args.out}: {len(texts)} answers, {sum(map(len, texts))} tokens, "
          f"{args.out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
