"""The benchmark suite: metrics on synthetic records, question loaders, configs, theory, resume, a tiny real run."""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2XS, STORIES, STORY_PROMPTS

from specula.bench import metrics, theory
from specula.bench.config import method_specs, parse_option, read_config
from specula.bench.questions import load_questions, read_questions, select
from specula.bench.runners import analyse_nodes
from specula.bench.suite import run_question as _original_run_question
from specula.cli import build_parser
from specula.cli.bench import bench_settings
from specula.decoding import node_records
from specula.errors import SpeculaError
from specula.runtime.profile import load_profile, profile_defaults, save_profile
from specula.runtime.weights import WEIGHT_FORMATS
from specula.tree import DraftTree

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def record(question, method, tps, new_tokens=10, cycles=5, category="c", temperature=0.0, tokens=None, **extra):
    tokens = tokens if tokens is not None else [1, 2, 3]
    return {"question": question, "method": method, "category": category, "temperature": temperature,
            "tokens_per_s": tps, "new_tokens": new_tokens, "cycles": cycles, "wall_time": new_tokens / tps,
            "turns": [{"token_ids": tokens}], "repetition": 0.0, **extra}


# ---------------------------------------------------------------- metrics


def test_tau_is_pooled_tokens_over_cycles():
    records = [record("a", "m", 1.0, new_tokens=10, cycles=5), record("b", "m", 1.0, new_tokens=30, cycles=5)]
    assert metrics.tau(records) == pytest.approx(40 / 10)
    assert metrics.tau([record("a", "hf", 1.0, cycles=None)]) is None


def test_speedup_is_a_ratio_of_means_not_a_mean_of_ratios():
    base = [record("a", "vanilla", 10.0), record("b", "vanilla", 30.0)]
    mine = [record("a", "m", 30.0), record("b", "m", 30.0)]
    assert metrics.speedup(mine, base) == pytest.approx(60 / 40)  # a mean of ratios would be (3 + 1) / 2 = 2
    # Only questions both ran are compared.
    assert metrics.speedup(mine[:1], base) == pytest.approx(3.0)


def test_depth_counts_are_n_alpha():
    # Chains of 3 drafts: accepted 0, 1, 3 (all), 2. Depth 1 tried 4x, accepted 3x; depth 2 tried 3x (cycles
    # that accepted >= 1), accepted 2x; depth 3 tried 2x, accepted 1x.
    accepted = [0, 1, 3, 2]
    tried_next = metrics.chain_tried_next(accepted, [3, 3, 3, 3])
    assert tried_next == [True, True, False, True]
    tried, hits = metrics.depth_counts(accepted, tried_next)
    assert tried == [4, 3, 2] and hits == [3, 2, 1]
    assert metrics.rates(tried, hits) == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert metrics.pooled_alpha(tried, hits) == pytest.approx(6 / 9)
    # A cycle with nothing to try at the next depth (draft ran out) is not a rejection there.
    assert metrics.depth_counts([1], [False]) == ([1], [1])


def test_greedy_equality_and_repetition():
    base = [record("a", "vanilla", 1.0, tokens=[1, 2]), record("b", "vanilla", 1.0, tokens=[3])]
    mine = [record("a", "m", 1.0, tokens=[1, 2]), record("b", "m", 1.0, tokens=[4])]
    assert metrics.greedy_equality(mine, base) == 0.5
    assert metrics.repetition([1, 2, 3, 4, 5]) == 0.0
    assert metrics.repetition([7] * 10, n=4) == pytest.approx(1 - 1 / 7)


def test_aggregate_per_category_and_best_transformers_baseline():
    records = [
        record("a", "vanilla", 10.0, category="x"), record("b", "vanilla", 20.0, category="y"),
        record("a", "pld", 20.0, category="x"), record("b", "pld", 20.0, category="y"),
        record("a", "hf", 5.0, category="x", cycles=None), record("b", "hf", 10.0, category="y", cycles=None),
    ]
    out = metrics.aggregate(records, ["vanilla", "pld", "hf"], hf_methods=["hf"])
    table = out["0"]
    assert table["pld"]["x"]["speedup"] == pytest.approx(2.0)
    assert table["pld"]["y"]["speedup"] == pytest.approx(1.0)
    assert table["pld"]["overall"]["speedup"] == pytest.approx(40 / 30)
    assert table["pld"]["overall"]["vs_best_hf"] == pytest.approx(20 / 7.5)
    assert table["hf"]["overall"]["tau"] is None
    assert table["pld"]["overall"]["greedy_equal"] == 1.0


def test_tau_by_context_pools_each_prompt_length_bucket_and_the_report_shows_it(tmp_path):
    from specula.bench.report import markdown

    def turn(prompt_tokens, new_tokens, cycles, wall):
        return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cycles": cycles, "wall_time": wall,
                "token_ids": [1] * new_tokens}

    long_chat = record("a", "m", 1.0, turns=[turn(100, 20, 10, 1.0), turn(600, 30, 10, 1.0),
                                             turn(2500, 10, 10, 2.0), turn(3900, 30, 10, 2.0)])
    other = record("b", "m", 1.0, turns=[turn(400, 40, 10, 1.0)])
    hf = record("a", "hf", 1.0, cycles=None, turns=[turn(100, 20, None, 1.0)])
    by_context = metrics.tau_by_context([long_chat, other])
    assert list(by_context) == ["<512", "512-1k", "2k-4k"]  # empty buckets are left out
    assert by_context["<512"] == {"turns": 2, "new_tokens": 60, "tau": 3.0, "tokens_per_s": 30.0}
    assert by_context["2k-4k"]["tau"] == pytest.approx(40 / 20) and by_context["2k-4k"]["tokens_per_s"] == 10.0
    assert metrics.tau_by_context([hf]) == {}  # no cycles counted: no τ
    table = metrics.aggregate([long_chat, other, hf], ["m", "hf"], hf_methods=["hf"])
    assert table["0"]["m"]["overall"]["by_context"] == by_context
    settings = {"target": "t", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 8, "top_k": 0,
                "top_p": 1.0, "seed": 0, "data": ["q"], "methods": {}}
    text = markdown({"settings": settings, "records": [long_chat, other, hf], "aggregates": table})
    assert "| method | <512 | 512-1k | 2k-4k |" in text
    assert "| m | 3.00 / 30.0 (2) | 3.00 / 30.0 (1) | 2.00 / 10.0 (2) |" in text
    assert "| hf |  |" not in text  # a row without τ is left out
    # One bucket only (short prompts): no such table.
    short = metrics.aggregate([other], ["m"])
    assert "By prompt length" not in markdown({"settings": settings, "records": [other], "aggregates": short})


def test_long_chat_questions_chain_the_source_turns_across_categories(tmp_path):
    import subprocess
    import sys

    source = tmp_path / "q.jsonl"
    source.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["w1a", "w1b"]},
        {"question_id": 2, "category": "writing", "turns": ["w2a"]},
        {"question_id": 3, "category": "math", "turns": ["m1a", "m1b"]}]) + "\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "long_chat_questions.py"
    out = tmp_path / "long.jsonl"
    run = subprocess.run([sys.executable, str(script), "--source", str(source), "--conversations", "2", "--turns", "2",
                          "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    chats = read_questions(out)
    assert [c.turns for c in chats] == [("w1a", "w1b"), ("m1a", "m1b")]  # writing, then math, then writing again
    assert {c.category for c in chats} == {"long_chat"}
    run = subprocess.run([sys.executable, str(script), "--source", str(source), "--conversations", "3", "--turns", "2",
                          "--out", str(tmp_path / "too_many.jsonl")], capture_output=True, text=True)
    assert run.returncode == 2 and "has 5 turns" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "too_many.jsonl").exists()


def test_calibration_histogram():
    cal = metrics.empty_calibration()
    for confidence, accepted in [(0.02, False), (0.03, True), (0.97, True), (1.0, True)]:
        metrics.add_to_calibration(cal, confidence, accepted)
    curve = metrics.calibration_curve(metrics.merge_calibration([cal, None]))
    assert [(round(c, 3), a, n) for c, a, n in curve] == [(0.025, 0.5, 2), (0.985, 1.0, 2)]


def test_node_records_are_the_tested_children_of_the_accepted_path():
    # root(5) -> 7 (conf .9) -> 8 (conf .6) -> 4 (conf .5); root -> 9 (conf .1). Accepted: 7, then 8 rejected.
    tree = DraftTree(torch.tensor([5, 7, 9, 8, 4]), [-1, 0, 0, 1, 3],
                     confidences=torch.tensor([1.0, 0.9, 0.1, 0.6, 0.5]))
    nodes = node_records(tree, [0, 1])
    # Both children of the root and the child of 7 were judged; 4, under the rejected 8, never was.
    assert nodes == [(pytest.approx(0.9), True, 1), (pytest.approx(0.1), False, 1), (pytest.approx(0.6), False, 2)]
    # Sampled drafts: the confidence is the draft distribution's probability of the token.
    probs = torch.zeros(2, 10)
    probs[:, 1], probs[:, 2] = 0.25, 0.75
    chain = DraftTree.chain(5, [1, 2], draft_probs=probs)
    assert node_records(chain, [0, 1, 2]) == [(0.25, True, 1), (0.75, True, 2)]
    # Prompt lookup knows no confidence: NaN, still counted by depth.
    (confidence, accepted, depth), = node_records(DraftTree.chain(5, [1, 2]), [0])
    assert math.isnan(confidence) and (accepted, depth) == (False, 1)


def test_analyse_nodes_counts_per_cycle_per_node_and_calibration():
    # Cycle 1: the tree above (accepted 1 draft, depth 2 tried). Cycle 2: a chain accepted in full
    # (nothing deeper to try). Cycle 3: lookup drafts without confidences, the first rejected.
    cycles = [[(0.9, True, 1), (0.1, False, 1), (0.6, False, 2)],
              [(0.8, True, 1), (0.7, True, 2)],
              [(math.nan, False, 1)]]
    out = analyse_nodes([1, 2, 0], cycles)
    assert (out.depth_tried, out.depth_accepted) == ([3, 2], [2, 1])  # per cycle (n-α)
    assert (out.node_depth_tried, out.node_depth_accepted) == ([4, 2], [2, 1])  # siblings count per node
    curve = metrics.calibration_curve(out.calibration)
    assert sum(n for _, _, n in curve) == 5 and curve[0] == (pytest.approx(0.1), 0.0, 1)
    assert analyse_nodes([0], [[(math.nan, False, 1)]]).calibration is None


def test_node_records_are_opt_in_and_match_the_accepted_lengths(stories_target):
    from specula.decoding import generate_tokens
    from specula.drafters.prompt_lookup import PromptLookupDrafter
    from specula.sampling import SamplingParams

    prompt = stories_target.tokenizer("Once upon a time. Once upon a time. Once upon", verbose=False).input_ids
    args = (stories_target, PromptLookupDrafter(), torch.tensor(prompt), 24, SamplingParams())
    plain_tokens, plain = generate_tokens(*args)
    tokens, stats = generate_tokens(*args, record_nodes=True)
    assert plain.nodes == [] and "nodes" not in plain.as_dict() and tokens == plain_tokens
    assert len(stats.nodes) == len(stats.accepted_lengths) and any(stats.accepted_lengths)
    for accepted, cycle in zip(stats.accepted_lengths, stats.nodes, strict=True):
        assert sum(on_path for _, on_path, _ in cycle) == accepted  # one accepted node per accepted depth


def test_report_plots_per_node_depth_and_accepts_older_records(tmp_path):
    from specula.bench.report import write_report

    old = record("a", "m", 1.0, depth_tried=[2], depth_accepted=[1])  # written before per-node counts existed
    new = record("b", "m", 1.0, depth_tried=[2, 1], depth_accepted=[1, 0], node_depth_tried=[3, 1],
                 node_depth_accepted=[1, 0], calibration=None)
    table = metrics.aggregate([old, new], ["m"])
    assert table["0"]["m"]["overall"]["node_acceptance_by_depth"] == [pytest.approx(1 / 3), 0.0]
    assert metrics.aggregate([old], ["m"])["0"]["m"]["overall"]["node_acceptance_by_depth"] is None
    results = {"settings": {"target": "t", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 8,
                            "top_k": 0, "top_p": 1.0, "seed": 0, "data": ["q"], "methods": {}},
               "records": [old, new], "aggregates": table}
    for path in write_report(results, tmp_path):
        assert path.stat().st_size > 0, path


def test_typical_rows_are_lossy_only_above_temperature_zero():
    from specula.bench.report import markdown

    records = [record("a", "typ", 1.0, temperature=t) for t in (0.0, 1.0)]
    results = {"settings": {"target": "t", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 8,
                            "top_k": 0, "top_p": 1.0, "seed": 0, "data": ["q"],
                            "methods": {"typ": {"method": "pld", "options": {"acceptance": "typical"}}}},
               "records": records, "aggregates": metrics.aggregate(records, ["typ"])}
    at_zero, at_one = markdown(results).split("## Temperature 1")
    assert "| typ (typical acceptance, exact at T=0) |" in at_zero and "LOSSY" not in at_zero
    assert "| typ (typical acceptance, LOSSY) |" in at_one


# ---------------------------------------------------------------- question loaders


def write_lines(path: Path, lines: list) -> Path:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_loaders_read_each_format(tmp_path):
    (tmp_path / "spec_bench").mkdir()
    spec = write_lines(tmp_path / "spec_bench" / "question.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["Write.", "Again."]},
        {"question_id": 2, "category": "stem", "turns": ["Why?"]},
        {"question_id": 3, "category": "translation", "turns": ["Translate."]},
    ])
    questions = read_questions(spec)
    assert [(q.uid, q.category, q.subcategory, len(q.turns)) for q in questions] == [
        ("spec_bench/1", "mt_bench", "writing", 2), ("spec_bench/2", "mt_bench", "stem", 1),
        ("spec_bench/3", "translation", "", 1)]
    mt = write_lines(tmp_path / "mt.jsonl", [{"question_id": 81, "category": "writing", "turns": ["a", "b"]}])
    assert read_questions(mt)[0].category == "writing"  # plain MT-bench keeps its categories
    human = write_lines(tmp_path / "HumanEval.jsonl.gz", [{"task_id": "HumanEval/0", "prompt": "def f():\n"}])
    (q,) = read_questions(human)
    assert (q.uid, q.category, q.turns) == ("humaneval/HumanEval/0", "humaneval", ("def f():\n",))
    code = write_lines(tmp_path / "pycode.jsonl", [{"question_id": "p-1", "category": "code", "prompt": "import os"}])
    assert read_questions(code)[0].category == "code"
    text = write_lines(tmp_path / "texts.jsonl", [{"text": "Once upon a time"}, "", {"text": "The end"}])
    assert [q.uid for q in read_questions(text)] == ["texts/1", "texts/3"]  # ids default to line numbers


@pytest.mark.parametrize("bad, fragment", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question": "x"}', "needs 'turns', 'prompt' or 'text'"),
    ('{"turns": []}', "'turns' must be a non-empty list"),
    ('{"turns": ["ok", 3]}', "every entry of 'turns'"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"text": 5}', "'text' must be a non-empty string"),
    ('{"question_id": 1, "prompt": "again"}', "duplicate question id"),
])
def test_loaders_reject_malformed_lines_naming_the_line(tmp_path, bad, fragment):
    path = write_lines(tmp_path / "q.jsonl", [{"question_id": 1, "prompt": "fine"}, "", bad])
    with pytest.raises(SpeculaError) as err:
        read_questions(path)
    assert f"{path}:3" in str(err.value) and fragment in str(err.value)


def test_gzip_loader_names_the_line_too(tmp_path):
    path = write_lines(tmp_path / "h.jsonl.gz", [{"task_id": "a", "prompt": "x"}, {"task_id": "b"}])
    with pytest.raises(SpeculaError, match=r"h\.jsonl\.gz:2"):
        read_questions(path)


def test_missing_or_empty_question_files(tmp_path):
    with pytest.raises(SpeculaError, match="not found"):
        read_questions(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SpeculaError, match="no questions"):
        read_questions(tmp_path / "empty.jsonl")


def test_limit_is_per_category_and_alternates_subcategories(tmp_path):
    lines = [{"question_id": i, "category": c, "turns": ["q"]}
             for i, c in enumerate(["writing"] * 3 + ["stem"] * 3 + ["qa"] * 3)]
    questions = read_questions(write_lines(tmp_path / "s.jsonl", lines))
    picked = select(questions, limit=2)
    assert [(q.category, q.subcategory) for q in picked] == [
        ("mt_bench", "writing"), ("mt_bench", "stem"), ("qa", ""), ("qa", "")]
    assert [q.subcategory for q in select(questions, ["stem"])] == ["stem"] * 3
    with pytest.raises(SpeculaError, match="no questions of categories nothing"):
        load_questions([tmp_path / "s.jsonl"], ["nothing"])


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data not present")
def test_the_shared_question_sets_load():
    counts = {name: len(read_questions(SHARED_DATA / name)) for name in
              ("spec_bench/question.jsonl", "mt_bench/question.jsonl", "humaneval/HumanEval.jsonl.gz",
               "pycode/eval.jsonl")}
    assert counts == {"spec_bench/question.jsonl": 480, "mt_bench/question.jsonl": 80,
                      "humaneval/HumanEval.jsonl.gz": 164, "pycode/eval.jsonl": 132}
    categories = {q.category for q in read_questions(SHARED_DATA / "spec_bench/question.jsonl")}
    assert categories == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


# ---------------------------------------------------------------- configs


def test_config_toml_json_and_options(tmp_path):
    toml = tmp_path / "b.toml"
    toml.write_text('[bench]\nmax_new_tokens = 8\n\n[methods.sps]\ndraft = "d"\nnum_tokens = 3\n\n'
                    '[methods.pld-short]\nmethod = "pld"\nnum_tokens = 2\n')
    config = read_config(toml)
    assert config["bench"] == {"max_new_tokens": 8}
    as_json = tmp_path / "b.json"
    as_json.write_text(json.dumps(config))
    assert read_config(as_json) == config
    specs = method_specs(["vanilla", "sps", "pld-short"], config["methods"], ["sps.num_tokens=5"],
                         defaults={"pld": {"num_tokens": 9, "max_ngram": 2}})
    assert [(s.label, s.method, s.draft, s.options) for s in specs] == [
        ("vanilla", "vanilla", None, {}), ("sps", "sps", "d", {"num_tokens": 5}),
        ("pld-short", "pld", None, {"num_tokens": 2, "max_ngram": 2})]  # config beats the profile's defaults
    assert parse_option("a.b=[1, 2]") == ("a", "b", [1, 2])
    assert parse_option("a.draft=../x") == ("a", "draft", "../x")


@pytest.mark.parametrize("labels, options, fragment", [
    (["nope"], [], "unknown method 'nope'"),
    (["hf_assisted"], [], "needs a draft model"),
    (["hf_pld"], ["hf_pld.depth=3"], "does not take option(s) depth"),
    (["pld"], ["sps.num_tokens=3"], "'sps' is not one of the methods"),
    (["pld"], ["pld-num_tokens=3"], "LABEL.KEY=VALUE"),
    (["pld", "pld"], [], "listed twice"),
])
def test_method_specs_reject_bad_input(labels, options, fragment):
    with pytest.raises(SpeculaError) as err:
        method_specs(labels, {}, options)
    assert fragment in str(err.value)


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[bench\n")
    with pytest.raises(SpeculaError, match="not valid TOML"):
        read_config(bad)
    bad.write_text("[bench]\nspeed = 1\n")
    with pytest.raises(SpeculaError, match="unknown \\[bench\\] key"):
        read_config(bad)


# ---------------------------------------------------------------- theory and profiles


def test_lecture_formulas_match_its_table_4():
    assert theory.expected_tokens(0.0, 5) == 1.0
    assert theory.expected_tokens(1.0, 5) == 6.0
    assert theory.expected_tokens(0.5, 2) == pytest.approx(1.75)
    # Table 4 rows (task, draft, T, γ, α, c, EXP): ENDE T5-small 7/0.75/0.02 → 3.2, T5-large 7/0.82/0.11 → 2.5,
    # CNNDM T5-base T=1 3/0.55/0.04 → 1.8.
    assert round(theory.improvement_factor(0.75, 7, 0.02), 1) == 3.2
    assert round(theory.improvement_factor(0.82, 7, 0.11), 1) == 2.5
    assert round(theory.improvement_factor(0.55, 3, 0.04), 1) == 1.8
    # More acceptance → longer best draft; costlier drafts → shorter.
    assert theory.best_gamma(0.9, 0.05) > theory.best_gamma(0.6, 0.05) > theory.best_gamma(0.6, 0.3)
    gamma = theory.best_gamma(0.8, 0.1)
    assert all(theory.improvement_factor(0.8, gamma, 0.1) >= theory.improvement_factor(0.8, g, 0.1)
               for g in range(1, 17))


def test_verify_cost_curve_and_hardware_factor():
    curve = {1: 1.0, 2: 1.0, 4: 2.0, 8: 4.0}
    assert theory.verify_cost(curve, 3) == pytest.approx(1.5)
    assert theory.verify_cost(curve, 16) == pytest.approx(8.0)  # extrapolates the last slope
    assert theory.hardware_improvement(0.5, 3, 0.1, curve) == pytest.approx(theory.expected_tokens(0.5, 3) / 2.3)
    assert theory.hardware_improvement(0.5, 3, 0.1) == pytest.approx(theory.improvement_factor(0.5, 3, 0.1))


def test_tree_model():
    # One child per node accepted with p: a chain, 1 + p + p^2 + ... tokens.
    plan = theory.tree_plan([0.5], nodes=3, depth=5)
    assert plan["nodes"] == 3 and plan["depth"] == 3 and plan["expected_tokens"] == pytest.approx(1.875)
    # Two ranks: the best 3 nodes are both children of the root (0.6, 0.3) and the top grandchild (0.36).
    plan = theory.tree_plan([0.6, 0.3], nodes=3, depth=5)
    assert plan["expected_tokens"] == pytest.approx(1 + 0.6 + 0.36 + 0.3) and plan["top_k"] == 2
    # With flat verification cost and free drafting, a chain's best tree is as long as allowed...
    flat = {1: 1.0, 128: 1.0}
    assert theory.best_tree([0.8], 0.0, flat, max_nodes=10, max_depth=10)["nodes"] == 10
    # ...and matches best_gamma when drafting costs something.
    best = theory.best_tree([0.8], 0.1, flat, max_nodes=16, max_depth=16)
    assert best["nodes"] == theory.best_gamma(0.8, 0.1, flat)
    # When nothing pays, draft nothing.
    assert theory.best_tree([0.1], 1.0, {1: 1.0, 2: 2.0})["nodes"] == 0


def test_profile_roundtrip_merge_and_device(tmp_path):
    path = tmp_path / "profile-m.json"
    base = {"target": "m", "device": "cpu", "dtype": "float32", "threads": 2, "target_step_s": 0.01,
            "verify_cost_s": {"1": 0.01}}
    save_profile({**base, "methods": {"sps": {"alpha": 0.7, "defaults": {"num_tokens": 3}}}}, path)
    save_profile({**base, "methods": {"eagle2": {"defaults": {"total_tokens": 8, "depth": 4, "top_k": 2}}}}, path)
    profile = load_profile("m", path)
    assert set(profile["methods"]) == {"sps", "eagle2"}
    assert profile_defaults(profile, "sps", "cpu") == {"num_tokens": 3}
    assert profile_defaults(profile, "sps", "cuda:0") == {}
    assert profile_defaults(profile, "pld", "cpu") == {}
    path.write_text("{broken")
    with pytest.raises(SpeculaError, match="cannot read hardware profile"):
        load_profile("m", path)


def test_default_profile_location(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    assert load_profile("nothing-here") is None
    save_profile({"target": "x", "device": "cpu", "methods": {"pld": {"defaults": {"num_tokens": 4}}}},
                 tmp_path / "profile-x.json")
    assert profile_defaults(load_profile("x"), "pld") == {"num_tokens": 4}


# ---------------------------------------------------------------- the commands, end to end on stories260k


def run_command(*argv) -> int:
    args = build_parser().parse_args([str(a) for a in argv])
    return args.handler(args)


@pytest.fixture
def story_questions(tmp_path) -> Path:
    return write_lines(tmp_path / "stories.jsonl", [
        {"question_id": "lily", "category": "story", "turns": ["Once upon a time", "Then"]},
        {"question_id": "tom", "category": "story", "prompt": "Tom and his dog went to the park"},
    ])


def bench_args(questions: Path, out: Path, *extra):
    return ["bench", "--target", STORIES, "--methods", "vanilla,pld", "--data", questions,
            "--max-new-tokens", 12, "--temperature", "0,1", "--threads", 1, "--dtype", "float32",
            "--out", out, "--no-progress", "--no-profile", *extra]


def test_bench_end_to_end_writes_every_output_and_resumes(tmp_path, story_questions, monkeypatch):
    from specula.bench import suite

    out = tmp_path / "out"
    assert run_command(*bench_args(story_questions, out)) == 0
    for name in ("results.json", "results.md", "speedup_tau.png", "acceptance_by_depth.png", "calibration.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == 2 * 2 * 2  # questions × methods × temperatures
    lily = next(r for r in results["records"] if r["question"] == "stories/lily" and r["method"] == "pld")
    assert len(lily["turns"]) == 2 and lily["turns"][1]["prompt_tokens"] > lily["turns"][0]["prompt_tokens"]
    overall = results["aggregates"]["0"]["pld"]["overall"]
    assert overall["greedy_equal"] == 1.0 and overall["questions"] == 2
    assert results["aggregates"]["0"]["vanilla"]["overall"]["tau"] == 1.0
    table = (out / "results.md").read_text()
    assert "| method | story | overall |" in table and "| pld |" in table and "1 threads" in table

    # Resume: nothing left to do, so no question runs again...
    def refuse(*args, **kwargs):
        raise AssertionError("a finished record was run again")

    monkeypatch.setattr(suite, "run_question", refuse)
    assert run_command(*bench_args(story_questions, out)) == 0
    # ...and after losing one record, exactly that one runs again.
    lost = results["records"].pop(3)
    (out / "results.json").write_text(json.dumps(results))
    ran = []

    def run_and_note(runner, spec, question, tokenizer, temperature, *rest):
        ran.append((question.uid, spec.label, temperature))
        return original(runner, spec, question, tokenizer, temperature, *rest)

    original = _original_run_question
    monkeypatch.setattr(suite, "run_question", run_and_note)
    assert run_command(*bench_args(story_questions, out)) == 0
    assert ran == [(lost["question"], lost["method"], lost["temperature"])]
    assert len(json.loads((out / "results.json").read_text())["records"]) == 8


def test_bench_refuses_to_resume_after_the_draft_changed_in_place(tmp_path, story_questions):
    """A head retrained at the same path must not be reported with records the old head produced."""
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(LLAMA2XS, draft)
    args = ["bench", "--target", STORIES, "--methods", "sps", "--option", f"sps.draft={draft}", "--data",
            story_questions, "--max-new-tokens", 4, "--temperature", "0", "--threads", 1, "--dtype", "float32",
            "--out", tmp_path / "out", "--no-progress", "--no-profile"]
    assert run_command(*args) == 0
    assert run_command(*args) == 0  # unchanged: resumes, nothing to run
    (draft / "generation_config.json").write_text('{"note": "retrained"}')
    with pytest.raises(SpeculaError, match="method 'sps' had other options"):
        run_command(*args)


def test_bench_refuses_to_mix_other_settings(tmp_path, story_questions):
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"settings": {"max_new_tokens": 99}, "records": [record("stories/tom", "vanilla", 1.0)]}
    (out / "results.json").write_text(json.dumps(earlier))
    with pytest.raises(SpeculaError, match="max_new_tokens=99"):
        run_command(*bench_args(story_questions, out))


def test_bench_bad_input_is_a_specula_error(tmp_path, story_questions):
    with pytest.raises(SpeculaError, match="unknown method 'warp'"):
        run_command("bench", "--target", STORIES, "--methods", "vanilla,warp", "--data", story_questions,
                    "--out", tmp_path)
    bad = write_lines(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "{oops"])
    with pytest.raises(SpeculaError, match="bad.jsonl:2"):
        run_command("bench", "--target", STORIES, "--methods", "vanilla", "--data", bad, "--out", tmp_path)
    with pytest.raises(SpeculaError, match="needs --out"):
        run_command("bench", "--target", STORIES, "--methods", "vanilla", "--data", story_questions)
    with pytest.raises(SpeculaError, match="temperature must be >= 0"):
        run_command(*bench_args(story_questions, tmp_path, "--temperature", "-1"))


def test_bench_runs_every_row_on_the_same_weights_and_records_the_format(tmp_path, story_questions):
    out = tmp_path / "out"
    args = ["bench", "--target", STORIES, "--methods", "vanilla,pld,hf", "--data", story_questions, "--limit", 1,
            "--max-new-tokens", 8, "--threads", 1, "--dtype", "float32", "--weights", "int8", "--out", out,
            "--no-progress", "--no-profile"]
    assert run_command(*args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["weights"] == "int8" and "--weights int8" in results["command"]
    assert "weights int8" in (out / "results.md").read_text()
    # The transformers baseline runs the same quantized model: at T=0 it decodes what vanilla decodes.
    by_method = {r["method"]: r for r in results["records"]}
    assert by_method["hf"]["turns"][0]["token_ids"] == by_method["vanilla"]["turns"][0]["token_ids"]
    assert by_method["pld"]["divergence"] is None and by_method["hf"]["divergence"] is None
    with pytest.raises(SpeculaError, match="weights='int8', this run has weights='float32'"):
        run_command(*args[:-6], "--weights", "float32", *args[-4:])


def test_bench_weights_from_a_config_file_are_checked(tmp_path, story_questions):
    config = tmp_path / "bench.toml"
    config.write_text('[bench]\nweights = "int3"\n')
    with pytest.raises(SpeculaError, match="unknown weights format 'int3'"):
        run_command(*bench_args(story_questions, tmp_path / "out", "--config", config))


def test_bench_compile_from_a_config_file_must_be_true_or_false(tmp_path, story_questions):
    config = tmp_path / "bench.toml"
    config.write_text('[bench]\ncompile = "yes"\n')
    with pytest.raises(SpeculaError, match="compile must be true or false, got 'yes'"):
        run_command(*bench_args(story_questions, tmp_path / "out", "--config", config))


def test_calibrate_records_the_weight_format_and_keeps_formats_apart(tmp_path, story_questions):
    out = tmp_path / "profile.json"
    common = ["calibrate", "--target", STORIES, "--data", story_questions, "--prompts", 1, "--max-new-tokens", 8,
              "--repeats", 1, "--threads", 1, "--out", out]
    assert run_command(*common, "--method", "pld", "--weights", "int8") == 0
    assert load_profile("stories260k", out)["weights"] == "int8"
    assert run_command(*common, "--method", "sps", "--draft", LLAMA2XS, "--weights", "float32") == 0
    profile = load_profile("stories260k", out)
    assert profile["weights"] == "float32" and set(profile["methods"]) == {"sps"}  # int8's pld not merged in


def test_calibrate_with_auto_weights_records_the_fastest_lossless_format(tmp_path, story_questions, capsys):
    out = tmp_path / "profile.json"
    code = run_command("calibrate", "--target", STORIES, "--method", "pld", "--data", story_questions,
                       "--prompts", 1, "--max-new-tokens", 8, "--repeats", 1, "--threads", 1, "--out", out)
    assert code == 0
    choice = load_profile("stories260k", out)["auto_weights"]
    measured = choice["formats"]
    assert set(measured) == set(WEIGHT_FORMATS[1:])
    assert measured["float32"]["agreement_with_float32"] == 1.0
    lossless = {fmt: m["step_s"] for fmt, m in measured.items()
                if m["available"] and m["real"] == 0 and m["agreement_with_float32"] >= 0.8}
    assert choice["choice"] == min(lossless, key=lossless.get)
    assert load_profile("stories260k", out)["weights"] == choice["choice"]  # the method is calibrated in it
    assert f"--weights auto means {choice['choice']}" in capsys.readouterr().out


def test_a_format_with_a_real_divergence_is_never_chosen(tmp_path, story_questions, monkeypatch):
    import specula.bench.calibrate as calibration
    from specula.divergence import REAL, Divergence

    steps = {"float32": 4e-3, "bfloat16": 3e-3, "int8": 2e-3, "int4": 1e-3, "q4_1": 5e-3}  # int4 the fastest
    monkeypatch.setattr(calibration, "measure_verify_curve",
                        lambda target, prefix, sizes, repeats: {1: steps[target.weights]})
    honest = calibration.check_greedy

    def int4_diverges(speculator, vanilla, prompts, max_new_tokens):
        result = honest(speculator, vanilla, prompts, max_new_tokens)
        if speculator.target.weights == "int4":  # a planted acceptance bug, only in this format
            result.divergences.append((0, Divergence(3, 1, 2, 5.0, 5.0, 1e-3, REAL)))
        return result

    monkeypatch.setattr(calibration, "check_greedy", int4_diverges)
    opts = calibration.CalibrationOptions(target=STORIES, method="pld", prompts=["Once upon a time"],
                                          max_new_tokens=8, repeats=1)
    choice = calibration.choose_weights(opts)
    assert choice["formats"]["int4"]["real"] == 1 and choice["choice"] == "int8"


def test_a_format_further_from_the_float32_model_than_allowed_is_never_chosen(monkeypatch):
    import specula.bench.calibrate as calibration

    steps = {"float32": 4e-3, "bfloat16": 3e-3, "int8": 2e-3, "int4": 1e-3, "q4_1": 5e-3}
    monkeypatch.setattr(calibration, "measure_verify_curve",
                        lambda target, prefix, sizes, repeats: {1: steps[target.weights]})
    # Four prompts are enough: int4 already leaves float32's greedy tokens within them (twenty took 17 s).
    opts = calibration.CalibrationOptions(target=STORIES, method="pld", prompts=STORY_PROMPTS[:4],
                                          max_new_tokens=32, repeats=1, min_agreement=1.0)
    choice = calibration.choose_weights(opts)
    agreement = {fmt: m["agreement_with_float32"] for fmt, m in choice["formats"].items() if m["available"]}
    assert agreement["int4"] < 1.0  # the fastest format changes some of the model's greedy tokens ...
    assert agreement[choice["choice"]] == 1.0  # ... so it is passed over for one that keeps them all
    assert choice["choice"] == min((f for f in agreement if agreement[f] == 1.0), key=steps.get)


def test_weights_auto_means_the_format_calibration_chose(tmp_path, monkeypatch):
    import specula

    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    file = tmp_path / "profile-stories260k.json"
    save_profile({"target": "stories260k", "device": "cpu", "auto_weights": {"choice": "int8"}}, file)
    assert specula.load(STORIES, method="pld").target.weights == "int8"
    assert specula.load(STORIES, method="pld", weights="float32").target.weights == "float32"
    assert specula.load(STORIES, method="pld", profile=False).target.weights == "float32"  # no profile: float32
    settings = bench_settings(build_parser().parse_args(
        ["bench", "--target", str(STORIES), "--methods", "vanilla", "--out", str(tmp_path / "out")]))
    assert settings.weights == "int8" and "--weights int8" in settings.command  # the report spells it out
    save_profile({"target": "stories260k", "device": "cuda", "auto_weights": {"choice": "int8"}}, file)
    assert specula.load(STORIES, method="pld").target.weights == "float32"  # measured on another device type


def test_bench_and_calibrate_run_on_the_threads_generate_decodes_on_unless_told(tmp_path):
    """Their rows and profiles describe what `generate` does: its thread rule unless --threads or a config says."""
    from specula.openmp import default_threads

    def threads(*extra):
        args = ["bench", "--target", str(STORIES), "--methods", "vanilla", "--out", str(tmp_path / "out"), *extra]
        return bench_settings(build_parser().parse_args(args)).threads

    config = tmp_path / "bench.toml"
    config.write_text("[bench]\nthreads = 2\n")
    assert threads() == default_threads()
    assert threads("--config", str(config)) == 2
    assert threads("--config", str(config), "--threads", "3") == 3
    assert build_parser().parse_args(["calibrate", "--method", "pld"]).threads == default_threads()


def test_calibrate_on_stories260k(tmp_path, story_questions, capsys):
    out = tmp_path / "profile.json"
    code = run_command("calibrate", "--target", STORIES, "--method", "sps", "--draft", LLAMA2XS,
                       "--option", "num_tokens=3", "--data", story_questions, "--prompts", 2,
                       "--max-new-tokens", 12, "--repeats", 1, "--threads", 1, "--out", out)
    assert code == 0
    printed = capsys.readouterr().out
    assert "EXP lecture" in printed and "best γ for chains" in printed
    profile = load_profile("stories260k", out)
    entry = profile["methods"]["sps"]
    assert set(profile["verify_cost_s"]) >= {"1", "2", "4", "8"}
    assert 0.0 <= entry["alpha"] <= 1.0 and entry["c"] > 0 and entry["measured_speedup"] > 0
    assert entry["defaults"] == {"num_tokens": entry["best_gamma"]}
    with pytest.raises(SpeculaError, match="cannot calibrate method 'vanilla'"):
        run_command("calibrate", "--target", STORIES, "--method", "vanilla")


def test_calibrate_compiled_measures_every_block_size_after_compiling_them(tmp_path, story_questions, capsys,
                                                                           monkeypatch):
    """A compiled step pads blocks to a few sizes: its verify cost is a staircase, measured size by size."""
    import specula.bench.calibrate as calibration

    monkeypatch.setattr(calibration, "WARM_UP_BLOCK", 4)  # blocks of 1, 2 and 4 tokens: three compilations
    out = tmp_path / "profile.json"
    code = run_command("calibrate", "--target", STORIES, "--method", "pld", "--option", "num_tokens=2",
                       "--weights", "float32", "--compile", "--data", story_questions, "--prompts", 1,
                       "--max-new-tokens", 8, "--repeats", 1, "--threads", 1, "--out", out)
    assert code == 0
    assert "float32 weights, compiled" in capsys.readouterr().out
    profile = load_profile("stories260k", out)
    assert profile["compile"] is True and set(profile["verify_cost_s"]) == {"1", "2", "3", "4"}
    assert 1 <= profile["methods"]["pld"]["best_gamma"] <= 3  # no chain longer than the measured sizes


def test_namespace_handlers_are_set():
    p = build_parser()
    for command in (["bench", "--out", "x"], ["calibrate", "--method", "pld"]):
        assert callable(p.parse_args(command).handler)
    assert isinstance(p.parse_args(["bench"]), argparse.Namespace)


def test_typical_acceptance_rows_are_marked_lossy(tmp_path, story_questions):
    config = tmp_path / "bench.toml"
    config.write_text('[methods.pld-typical]\nmethod = "pld"\nacceptance = "typical"\nposterior_alpha = 0.2\n')
    out = tmp_path / "out"
    argv = bench_args(story_questions, out, "--config", config, "--limit", 1)
    argv[argv.index("--methods") + 1] = "vanilla,pld-typical"
    argv[argv.index("--temperature") + 1] = "1"
    assert run_command(*argv) == 0
    table = (out / "results.md").read_text()
    assert "| pld-typical (typical acceptance, LOSSY) |" in table and "| vanilla |" in table


def test_generate_takes_profile_defaults_under_explicit_options(tmp_path, monkeypatch):
    import specula

    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    save_profile({"target": "stories260k", "device": "cpu", "methods": {"pld": {"defaults": {"num_tokens": 2}}}},
                 tmp_path / "profile-stories260k.json")
    assert specula.load(STORIES, method="pld").drafter.num_tokens == 2
    assert specula.load(STORIES, method="pld", num_tokens=7).drafter.num_tokens == 7
    assert specula.load(STORIES, method="pld", profile=False).drafter.num_tokens != 2


def test_tree_sweep_prints_every_setting_against_the_first_and_refuses_bad_settings(tmp_path, capsys):
    import runpy

    from conftest import STORIES, STORY_PROMPTS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in STORY_PROMPTS[:2]))
    # In this process (the script's main, as its __main__ calls it): six processes cost ~20 s of imports and loads.
    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "tree_sweep.py"))
    common = ["--target", str(STORIES), "--prompts", str(prompts), "--max-new-tokens", "8"]

    def sweep(*argv: str) -> tuple[int, str, str]:
        code = script["main"]([*common, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = sweep("vanilla", 'pld={"num_tokens": 3}')
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and "1.00x" in lines[0] and "tau 1.00" in lines[0]
    assert 'pld={"num_tokens": 3}' in lines[1] and "tokens/s" in lines[1]
    code, out, err = sweep("--temperature", "1", "vanilla", "vanilla")
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines()] == ["T=1", "T=1"]
    code, out, err = sweep("--temperature", "-1", "vanilla")
    assert code == 2 and len(err.splitlines()) == 1 and "temperature" in err, err
    code, out, err = sweep("--max-new-tokens", "0", "vanilla")
    assert code == 2 and err == "tree_sweep: --max-new-tokens must be >= 1, got 0\n", err
    code, out, err = sweep("vanilla", 'pld={"num_tokens": 0}')
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    prompts.write_text('{"text": "no prompt field"}\n')
    code, out, err = sweep("vanilla")
    assert code == 2 and "expected an object with a non-empty string 'prompt'" in err


def test_the_recorded_command_of_a_config_run_runs_the_same_methods_without_the_config(tmp_path, story_questions):
    """A config's ``[methods.LABEL]`` with its own ``method`` key is spelled out as ``--option LABEL.method=...``:
    results.md's command line alone reruns the run (it used to name a label no command line could resolve)."""
    import shlex

    config = tmp_path / "b.toml"
    config.write_text('[methods.pld-short]\nmethod = "pld"\nnum_tokens = 2\n')
    first = tmp_path / "first"
    assert run_command("bench", "--config", config, "--target", STORIES, "--methods", "vanilla,pld-short", "--data",
                       story_questions, "--limit", 1, "--max-new-tokens", 4, "--temperature", 0, "--threads", 1,
                       "--dtype", "float32", "--out", first, "--no-progress", "--no-profile") == 0
    recorded = json.loads((first / "results.json").read_text())
    argv = shlex.split(recorded["command"])
    assert argv[:2] == ["specula", "bench"] and "--config" not in argv
    again = tmp_path / "again"
    argv[argv.index("--out") + 1] = str(again)
    assert run_command(*argv[1:], "--no-progress") == 0
    rerun = json.loads((again / "results.json").read_text())
    assert rerun["settings"]["methods"] == recorded["settings"]["methods"]
