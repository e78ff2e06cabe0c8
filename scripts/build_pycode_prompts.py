"""Build code-completion training prompts from this machine's Python standard library.

Two kinds of prompt, half each, cut like the evaluation set ../shared/data/pycode/eval.jsonl:
  (a) a file's text up to the end of a function's or method's docstring (signature + docstring at the
      end, preceded by as much of the file as fits);
  (b) a file's text up to a random line.
Each prompt keeps whole lines and at most a random 1/3..1 of ``--max-chars`` characters. The output is
JSONL of ``{"prompt": ...}``, deterministic for a given seed and Python installation.

Nothing may come from an evaluation set. Read from ../shared: the held-out files of the reference target
(models/pycoder-25m/heldout_files.jsonl, records {"text"}; they carry no path, so files are compared by
content), the pycode eval prompts (data/pycode/eval.jsonl) and HumanEval (data/humaneval/HumanEval.jsonl.gz,
prompt + canonical solution + test). Excluded are: standard-library files whose normalised content hash
equals a held-out file's; files that are near-copies of one (more than 5% of their 200-character windows,
whitespace-collapsed, occur in the evaluation texts); and any prompt that shares a 200-character window
with an evaluation text, is (when shorter than 200) contained in one, or ends in a signature + docstring
identical to one in them.

    .venv/bin/python scripts/build_pycode_prompts.py --count 4000 --seed 0 --out data/pycode_train_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import bisect
import gzip
import hashlib
import json
import random
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
HELDOUT = SHARED / "models" / "pycoder-25m" / "heldout_files.jsonl"
PYCODE_EVAL = SHARED / "data" / "pycode" / "eval.jsonl"
HUMANEVAL = SHARED / "data" / "humaneval" / "HumanEval.jsonl.gz"
SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "encodings", "__pycache__", "_bundled"}
WINDOW = 200
NEAR_COPY = 0.05
MIN_BYTES, MAX_BYTES = 200, 200_000


def content_hash(text: str) -> str:
    """Hash of a file ignoring line endings, trailing spaces and surrounding blank lines."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return hashlib.sha256("\n".join(lines).strip().encode()).hexdigest()


def collapse(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def windows(text: str) -> set[int]:
    return {hash(text[i:i + WINDOW]) for i in range(len(text) - WINDOW + 1)}


def signature_docstrings(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, collapsed text) of each function's signature + docstring, 1-based lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) is not None:
            last = node.body[0].end_lineno
            found.append((node.lineno, last, collapse("".join(lines[node.lineno - 1:last]))))
    return found


def load_eval_texts() -> tuple[list[str], dict[str, int]]:
    """Every evaluation text, and how many came from each source."""
    for path in (HELDOUT, PYCODE_EVAL, HUMANEVAL):
        if not path.is_file():
            sys.exit(f"evaluation set missing: {path}")
    heldout = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines() if line.strip()]
    pycode = [json.loads(line)["prompt"] for line in PYCODE_EVAL.read_text().splitlines() if line.strip()]
    with gzip.open(HUMANEVAL, "rt") as lines:
        humaneval = [json.loads(line) for line in lines if line.strip()]
    human_texts = [r["prompt"] + r["canonical_solution"] for r in humaneval] + [r["test"] for r in humaneval]
    counts = {"held-out files": len(heldout), "pycode eval prompts": len(pycode), "HumanEval problems": len(humaneval)}
    return heldout + pycode + human_texts, counts


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIP_DIRS for part in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        if MIN_BYTES <= path.stat().st_size <= MAX_BYTES:
            files.append(path)
    return files


def trim(prefix_lines: list[str], limit: int, keep_from: int) -> str | None:
    """The last whole lines of ``prefix_lines`` within ``limit`` chars; None unless they reach back to keep_from."""
    total, start = 0, len(prefix_lines)
    while start > 0 and total + len(prefix_lines[start - 1]) <= limit:
        start -= 1
        total += len(prefix_lines[start])
    if start > keep_from or total == 0:
        return None
    return "".join(prefix_lines[start:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=4000, help="number of prompts (default 4000)")
    parser.add_argument("--max-chars", type=int, default=1500, help="longest prompt in characters (default 1500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "data" / "pycode_train_prompts.jsonl")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    eval_texts, eval_counts = load_eval_texts()
    heldout_hashes = {content_hash(t) for t in eval_texts[: eval_counts["held-out files"]]}
    collapsed_eval = [collapse(t) for t in eval_texts]
    eval_windows: set[int] = set()
    for text in collapsed_eval:
        eval_windows |= windows(text)
    eval_joined = "\x00".join(collapsed_eval)
    eval_signatures = {sig for text in eval_texts for _, _, sig in signature_docstrings(text)}
    print(f"evaluation texts: {eval_counts}; {len(eval_windows)} distinct {WINDOW}-char windows, "
          f"{len(eval_signatures)} signature+docstring blocks")

    root = Path(sysconfig.get_paths()["stdlib"])
    excluded_files: Counter[str] = Counter()
    sources: list[tuple[str, list[str]]] = []
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
            ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            excluded_files["not UTF-8 or not parseable"] += 1
            continue
        if content_hash(text) in heldout_hashes:
            excluded_files["same content as a held-out file"] += 1
            continue
        mine = collapse(text)
        own = windows(mine)
        if own and len(own & eval_windows) > NEAR_COPY * len(own):
            excluded_files[f"near-copy of an evaluation text (>{NEAR_COPY:.0%} shared windows)"] += 1
            continue
        sources.append((str(path.relative_to(root)), text.splitlines(keepends=True)))
    print(f"standard library {root}: {len(sources)} files used; excluded {dict(excluded_files) or 'none'}")

    # (a) candidates: every documented function; (b) candidates: random lines, uniform over all lines.
    docstring_cuts = [(f, first, last) for f, (_, lines) in enumerate(sources)
                      for first, last, _ in signature_docstrings("".join(lines))]
    rng.shuffle(docstring_cuts)
    line_starts = [0]
    for _, lines in sources:
        line_starts.append(line_starts[-1] + len(lines))
    random_lines = rng.sample(range(line_starts[-1]), min(line_starts[-1], 4 * args.count))

    excluded_prompts: Counter[str] = Counter()
    seen: set[str] = set()

    def accept(prompt: str | None, signature: str | None) -> bool:
        if prompt is None or not prompt.strip():
            excluded_prompts["does not fit in the length limit"] += 1
            return False
        if prompt in seen:
            excluded_prompts["duplicate"] += 1
            return False
        flat = collapse(prompt)
        if signature is not None and signature in eval_signatures:
            excluded_prompts["signature+docstring identical to an evaluation one"] += 1
            return False
        if len(flat) >= WINDOW and not windows(flat).isdisjoint(eval_windows):
            excluded_prompts[f"shares a {WINDOW}-char window with an evaluation text"] += 1
            return False
        if len(flat) < WINDOW and flat in eval_joined:
            excluded_prompts["contained in an evaluation text"] += 1
            return False
        seen.add(prompt)
        return True

    want_a = args.count // 2
    kind_a: list[dict] = []
    for f, first, last in docstring_cuts:
        if len(kind_a) >= want_a:
            break
        name, lines = sources[f]
        prompt = trim(lines[:last], rng.randint(args.max_chars // 3, args.max_chars), first - 1)
        signature = collapse("".join(lines[first - 1:last]))
        if accept(prompt, signature):
            kind_a.append({"prompt": prompt, "source": name, "kind": "docstring"})
    kind_b: list[dict] = []
    for index in random_lines:
        if len(kind_a) + len(kind_b) >= args.count:
            break
        f = bisect.bisect_right(line_starts, index) - 1
        name, lines = sources[f]
        cut = index - line_starts[f] + 1  # keep lines [0, cut)
        prompt = trim(lines[:cut], rng.randint(args.max_chars // 3, args.max_chars), cut - 1)
        if accept(prompt, None):
            kind_b.append({"prompt": prompt, "source": name, "kind": "line"})
    records = kind_a + kind_b
    rng.shuffle(records)
    print(f"prompts: {len(kind_a)} docstring cuts + {len(kind_b)} random-line cuts = {len(records)}; "
          f"excluded {dict(excluded_prompts) or 'none'}")
    if len(records) < args.count:
        print(f"warning: only {len(records)} of the {args.count} prompts requested could be made")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps({"prompt": record["prompt"]}) + "\n")
    size = args.out.stat().st_size
    chars = sum(len(r["prompt"]) for r in records)
    print(f"wrote {args.out} ({size / 1e6:.2f} MB, {len(records)} prompts, {chars / max(1, len(records)):.0f} "
          f"chars on average, from {len({r['source'] for r in records})} files)")


if __name__ == "__main__":
    main()
