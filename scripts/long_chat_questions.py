"""Long conversations for measuring τ against context length: a question set's questions asked one after another.

Each output question is one conversation whose turns are the turns of consecutive source questions (the
categories taken in turn, so one conversation mixes writing, maths, coding, ...). `specula bench` runs a
question's turns in order with the model's own answers in the context, so the later turns of a
conversation see thousands of tokens of it: with 256 new tokens per answer, SmolLM2's context passes
2,000 tokens after about 7 MT-bench turns and 4,000 after about 13. The bench report then gives τ by
prompt length (its "By prompt length" table).

    .venv/bin/python scripts/long_chat_questions.py --source ../shared/data/mt_bench/question.jsonl \\
        --conversations 2 --turns 14 --out runs/long_chat.jsonl
"""

import argparse
import json
import sys
from itertools import chain, zip_longest
from pathlib import Path

from specula.bench.questions import read_questions
from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_text


def conversations(source: str | Path, count: int, turns: int) -> list[dict]:
    """``count`` conversations of ``turns`` turns each, from the source's questions in category-interleaved order."""
    by_category: dict[str, list] = {}
    for question in read_questions(source):
        by_category.setdefault(question.category, []).append(question)
    ordered = [q for q in chain.from_iterable(zip_longest(*by_category.values())) if q is not None]
    pool = [turn for question in ordered for turn in question.turns]
    if count * turns > len(pool):
        raise SpeculaError(f"{source} has {len(pool)} turns, fewer than {count} conversations x {turns} turns")
    return [{"question_id": f"long-chat-{k + 1}", "category": "long_chat", "turns": pool[k * turns:(k + 1) * turns]}
            for k in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a question file `specula bench` reads (e.g. MT-bench)")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=14, help="user turns per conversation")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        if args.conversations < 1 or args.turns < 1:
            raise SpeculaError("--conversations and --turns must be at least 1")
        lines = [json.dumps(c, ensure_ascii=False) for c in conversations(args.source, args.conversations, args.turns)]
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    except SpeculaError as error:
        print(f"long_chat_questions: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.conversations} conversations of {args.turns} turns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
