"""Benchmark question sets: one reader for every format the suite accepts.

Each JSONL line (plain or ``.gz``) is one question. Its turns come from the
first of these fields a record has:

- ``turns``: a list of strings, run one after another (Spec-Bench, MT-bench);
- ``prompt``: one string, used verbatim (HumanEval, pycode);
- ``text``: one string (any plain-text set).

The id is ``question_id``, ``task_id`` or ``id`` (else the line number) and the
category is ``category`` (else the file's dataset name, e.g. ``humaneval``).
In a Spec-Bench file (one holding any of its own task categories) the eight
MT-bench categories are reported together as ``mt_bench``, as Spec-Bench does;
the original category is kept as ``subcategory``.
"""

from __future__ import annotations

import gzip
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

from specula.errors import SpeculaError
from specula.files.jsonl import json_lines

SPEC_BENCH_TASKS = {"translation", "summarization", "qa", "math_reasoning", "rag"}
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass(frozen=True)
class Question:
    """One benchmark question: an id unique across data files, a category and one or more user turns."""

    uid: str  # "<dataset>/<question id>"
    dataset: str
    category: str
    turns: tuple[str, ...]
    subcategory: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def dataset_name(path: Path) -> str:
    """``spec_bench`` for .../spec_bench/question.jsonl, ``humaneval`` for HumanEval.jsonl.gz, else the stem."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    if name in ("question", "questions", "eval", "test", "data") and path.parent.name:
        return path.parent.name
    return name.lower()


def _open(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _turns(record: dict, where: str) -> tuple[str, ...]:
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise SpeculaError(f"{where}: 'turns' must be a non-empty list of strings")
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise SpeculaError(f"{where}: every entry of 'turns' must be a non-empty string")
        return tuple(turns)
    for key in ("prompt", "text"):
        if key in record:
            value = record[key]
            if not isinstance(value, str) or not value.strip():
                raise SpeculaError(f"{where}: '{key}' must be a non-empty string")
            return (value,)
    raise SpeculaError(f"{where}: a question needs 'turns', 'prompt' or 'text' (found {', '.join(record) or 'none'})")


def read_questions(path: str | Path) -> list[Question]:
    """Every question in ``path``; a malformed line raises SpeculaError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise SpeculaError(f"question file not found: {path}")
    dataset = dataset_name(path)
    questions: list[Question] = []
    seen: set[str] = set()
    try:
        with _open(path) as lines:
            for number, where, record in json_lines(lines, lambda n: f"{path}:{n}"):
                if not isinstance(record, dict):
                    raise SpeculaError(f"{where}: expected a JSON object, got {type(record).__name__}")
                turns = _turns(record, where)
                qid = next((record[k] for k in ("question_id", "task_id", "id") if k in record), number)
                if not isinstance(qid, (str, int)):
                    raise SpeculaError(f"{where}: the question id must be a string or an integer")
                category = record.get("category", dataset)
                if not isinstance(category, str) or not category:
                    raise SpeculaError(f"{where}: 'category' must be a non-empty string")
                uid = f"{dataset}/{qid}"
                if uid in seen:
                    raise SpeculaError(f"{where}: duplicate question id {qid!r}")
                seen.add(uid)
                questions.append(Question(uid, dataset, category, turns, meta={"line": number}))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise SpeculaError(f"cannot read question file {path}: {err}") from err
    if not questions:
        raise SpeculaError(f"question file {path} holds no questions")
    if any(q.category in SPEC_BENCH_TASKS for q in questions):
        questions = [
            Question(q.uid, q.dataset, "mt_bench", q.turns, q.category, q.meta) if q.category in MT_BENCH_CATEGORIES
            else q for q in questions
        ]
    return questions


def select(questions: list[Question], categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """Questions of the given categories (matching category or subcategory), at most ``limit`` per category.

    Within a category that has subcategories (Spec-Bench's mt_bench) the picks
    alternate between subcategories, so a small limit still covers them all.
    """
    if categories:
        wanted = set(categories)
        questions = [q for q in questions if q.category in wanted or q.subcategory in wanted]
    if limit is None:
        return list(questions)
    by_category: dict[str, dict[str, list[Question]]] = defaultdict(lambda: defaultdict(list))
    for q in questions:
        by_category[q.category][q.subcategory].append(q)
    chosen: set[str] = set()
    for groups in by_category.values():
        interleaved = [q for row in zip_longest(*groups.values()) for q in row if q is not None]
        chosen.update(q.uid for q in interleaved[:limit])
    return [q for q in questions if q.uid in chosen]


def load_questions(paths: list[str | Path], categories: list[str] | None = None,
                   limit: int | None = None) -> list[Question]:
    """Questions of several files, filtered and limited per file; ids must be unique across files."""
    result: list[Question] = []
    seen: set[str] = set()
    for path in paths:
        picked = select(read_questions(path), categories, limit)
        for q in picked:
            if q.uid in seen:
                raise SpeculaError(f"question {q.uid} appears in two data files; rename one of the files")
            seen.add(q.uid)
        result.extend(picked)
    if not result:
        wanted = f" of categories {', '.join(categories)}" if categories else ""
        raise SpeculaError(f"no questions{wanted} in {', '.join(str(p) for p in paths)}")
    return result
