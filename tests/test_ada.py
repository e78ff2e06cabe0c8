"""AdaEAGLE (`ada`): LDLP checkpoints, labels, training, greedy equality, T > 0 losslessness, CLI errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STORIES, STORY_PROMPTS
from test_eagle_sampling import HEAD, PROMPT
from test_lossless_sampling import (
    ALPHA,
    E2E_NEW_TOKENS,
    E2E_PARAMS,
    accept_bonus_from_unmodified_p,
    encode,
    exact_sequence_distribution,
    fit_pvalues,
    run_generation,
)

import specula
from specula.cli import main
from specula.drafters.ada import AdaDrafter
from specula.errors import SpeculaError
from specula.heads.eagle_head import EagleHead
from specula.heads.ldlp import LengthPredictor, head_fingerprint
from specula.runtime.plain_model import transformers_model
from specula.training.chain import chain_acceptance, chain_labels
from specula.training.ldlp_trainer import LdlpTrainOptions, replay, train_ldlp
from specula.training.loop import TrainConfig

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def head(stories_target) -> EagleHead:
    return EagleHead.from_pretrained(HEAD)


@pytest.fixture(scope="module")
def ldlp_dir(stories_target, stories_samples, head, tmp_path_factory) -> Path:
    """An LDLP trained for the test head on the story continuations (16 train, 4 held out)."""
    out = tmp_path_factory.mktemp("ldlp")
    config = TrainConfig(epochs=12, batch_size=4, lr=3e-3, warmup_steps=4, save_every=1000)
    options = LdlpTrainOptions(max_draft_length=6, intermediate_size=64)
    train_ldlp(stories_target, head, head_fingerprint(HEAD), stories_samples[:16], stories_samples[16:], out, config,
               options, log=lambda _: None)
    return out


# ---------------------------------------------------------------- checkpoints


def test_ldlp_round_trip(stories_target, tmp_path):
    torch.manual_seed(0)
    predictor = LengthPredictor.for_target(stories_target.config, max_draft_length=5, intermediate_size=32,
                                           head_fingerprint="abc", penalty=2.0)
    predictor.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "specula-ldlp" and config["max_draft_length"] == 5
    assert config["draft_head_fingerprint"] == "abc"
    loaded = LengthPredictor.from_pretrained(tmp_path)
    for name, tensor in predictor.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    embed, hidden = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(loaded(embed, hidden), predictor(embed, hidden))
    assert 1 <= loaded.draft_length(embed[0], hidden[0]) <= 5
    assert not list(tmp_path.glob(".*"))  # atomic writes leave no temporary files


def test_ldlp_with_mismatched_config_or_tensors_is_refused(stories_target, tmp_path):
    LengthPredictor.for_target(stories_target.config, intermediate_size=32).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=48)))
    with pytest.raises(SpeculaError, match="shape"):
        LengthPredictor.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    with pytest.raises(SpeculaError, match="not an LDLP"):
        LengthPredictor.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(SpeculaError, match="hidden_size"):
        LengthPredictor.from_pretrained(tmp_path)
    with pytest.raises(SpeculaError, match="no config.json"):
        LengthPredictor.from_pretrained(tmp_path / "absent")


def test_ldlp_that_does_not_fit_the_target_or_head_is_refused(stories_target, tmp_path):
    from transformers import LlamaConfig

    other = LlamaConfig(hidden_size=32, vocab_size=512)
    LengthPredictor.for_target(other, head_fingerprint=head_fingerprint(HEAD)).save_pretrained(tmp_path / "small")
    with pytest.raises(SpeculaError, match="hidden size 64"):
        specula.load(STORIES, method="ada", draft=HEAD, ldlp=tmp_path / "small", dtype="float32")
    LengthPredictor.for_target(stories_target.config, head_fingerprint="0" * 16).save_pretrained(tmp_path / "other")
    with pytest.raises(SpeculaError, match="another EAGLE head"):
        specula.load(STORIES, method="ada", draft=HEAD, ldlp=tmp_path / "other", dtype="float32")
    bare = tmp_path / "bare-head"  # the head without its ldlp/ subfolder
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(HEAD / name, bare / name)
    with pytest.raises(SpeculaError, match="no LDLP"):
        specula.load(STORIES, method="ada", draft=bare, dtype="float32")
    with pytest.raises(SpeculaError, match="predicts the depth"):
        specula.load(STORIES, method="ada", draft=HEAD, ldlp=tmp_path / "other", depth=3, dtype="float32")


# ---------------------------------------------------------------- labels and training


def sequential_labels(head, target, sample, max_length: int) -> dict[int, tuple[int, bool]]:
    """Reference: draft each position's chain on its own, one draft at a time."""
    embed = target.model.get_input_embeddings()
    ids, response, features = sample["input_ids"], sample["loss_mask"], sample["hidden"]
    labels = {}
    for s in (s for s in range(len(ids) - 2) if response[s + 2]):
        cache = head.new_cache(len(ids) + max_length)
        pairs = torch.arange(s + 1)
        feature = head.step(features[pairs], embed(ids[pairs + 1]), pairs, cache, None)[-1:]
        cache.commit()
        count, censored = 0, False
        for n in range(max_length):
            wanted = s + 2 + n
            if wanted >= len(ids) or not response[wanted]:
                censored = True
                break
            guess = int(head.token_log_probs(feature).argmax(-1))
            if guess != int(ids[wanted]):
                break
            count += 1
            feature = head.step(feature, embed(torch.tensor([guess])), torch.tensor([s + 1 + n]), cache, None,
                                own_features=True)
            cache.commit()
        labels[s] = (count, censored)
    return labels


@torch.no_grad()
def test_batched_labels_equal_chains_drafted_one_at_a_time(stories_target, stories_samples, head):
    for sample in stories_samples[:3]:
        labels, censored = chain_labels(head, stories_target, sample, max_length=6)
        got = {s: (int(labels[s]), bool(censored[s])) for s in range(len(labels)) if labels[s] >= 0}
        expected = sequential_labels(head, stories_target, sample, 6)
        assert got == expected
        assert any(count >= 2 for count, _ in got.values())  # chains really continue past one draft


@torch.no_grad()
def test_chain_acceptance_counts_each_judged_draft_once(stories_target, stories_samples, head):
    samples = stories_samples[:3]
    tried, hits = [0] * 4, [0] * 4
    for sample in samples:
        for count, censored in sequential_labels(head, stories_target, sample, 4).values():
            for n in range(4):
                tried[n] += count > n or (count == n and not censored)
                hits[n] += count > n
    expected = [h / t if t else 0.0 for h, t in zip(hits, tried, strict=True)]
    assert chain_acceptance(head, stories_target, samples, max_steps=4) == pytest.approx(expected)
    assert expected[0] > 0.3


def test_replay_moves_past_the_accepted_drafts():
    response = torch.tensor([False, False, True, True, True, True, True, True])
    labels = torch.tensor([-1, 2, 0, 1, 0, 0, -1, -1])  # the first cycle drafts after position 1
    # Two drafts after s=1 accept both (s -> 4); one after s=4 accepts 0 (s -> 5); then 0 (s -> 6, unlabelled).
    assert replay(labels, response, lambda s: 2 if s == 1 else 1) == (3, 4, 2)
    assert replay(labels, response, lambda s: 1) == (3, 3, 2)  # s = 1 -> 3 -> 5 -> 6, accepting 1, 1, 0


def test_training_loss_falls_and_the_comparison_is_written(ldlp_dir):
    history = json.loads((ldlp_dir / "training_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4
    report = json.loads((ldlp_dir / "evaluation.json").read_text())
    policies = report["policies"]
    assert {"ldlp", "oracle", "fixed-1", "fixed-6"} <= set(policies)
    assert report["positions"] > 100 and report["mean_abs_error"] < 2.0
    # The oracle drafts exactly what is accepted; a fixed length of 6 wastes drafts that length 1 does not.
    assert policies["oracle"]["tau"] >= max(row["tau"] for row in policies.values()) - 1e-9
    assert policies["fixed-6"]["accepted_per_drafted"] < policies["fixed-1"]["accepted_per_drafted"]


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("tree", [False, True], ids=["ada", "ada-tree"])
def test_greedy_output_equals_transformers_generate(tree, ldlp_dir):
    reference = specula.load(STORIES, method="vanilla", dtype="float32")
    speculator = specula.load(STORIES, method="ada", draft=HEAD, ldlp=ldlp_dir, tree=tree, dtype="float32")
    assert speculator.drafter.name == ("ada-tree" if tree else "ada")
    accepted, lengths = 0, set()
    for prompt in STORY_PROMPTS[:10]:
        ids = reference.encode(prompt)
        model = transformers_model(reference.target.model)
        expected = model.generate(ids[None], max_new_tokens=40, do_sample=False)[0, len(ids):]
        result = speculator.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected.tolist(), prompt
        accepted += sum(result.stats.accepted_lengths)
        lengths.update(speculator.drafter.predicted_lengths)
    assert accepted > 0, "no draft was ever accepted, so equality proved little"
    assert len(lengths) > 1, "the predictor never changed the draft length"


def test_chain_length_follows_the_prediction(stories_target, head, ldlp_dir):
    predictor = LengthPredictor.from_pretrained(ldlp_dir)
    drafter = AdaDrafter(stories_target, head, predictor)
    prompt = encode(stories_target, STORY_PROMPTS[2])
    out = stories_target.prefill(prompt, drafter.features)
    drafter.start(prompt, out)
    context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
    tree = drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None)
    assert tree.is_chain and len(tree) == 1 + drafter.predicted_lengths[-1]
    assert drafter.cache.length == len(context) - 1  # draft entries were discarded


def ada_pvalues(target, head, ldlp_dir, acceptor=None) -> tuple[dict[str, float], int]:
    drafter = AdaDrafter(target, head, LengthPredictor.from_pretrained(ldlp_dir))
    prompt = encode(target, PROMPT)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, E2E_NEW_TOKENS)
    counts, accepted = run_generation(target, drafter, prompt, acceptor)
    return fit_pvalues(counts, exact, E2E_NEW_TOKENS), accepted


def test_ada_sampling_matches_target_distribution(stories_target, head, ldlp_dir):
    result, accepted = ada_pvalues(stories_target, head, ldlp_dir)
    assert accepted > 400, accepted  # sampled chains really were accepted: the test is not vacuous
    assert min(result.values()) >= ALPHA, result


def test_ada_with_broken_acceptor_is_rejected(stories_target, head, ldlp_dir):
    result, _ = ada_pvalues(stories_target, head, ldlp_dir, acceptor=accept_bonus_from_unmodified_p)
    assert min(result.values()) < ALPHA, result


# ---------------------------------------------------------------- command line


def run(capfd, *args) -> tuple[int, str, str]:
    code = main([*map(str, args)])
    out, err = capfd.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("specula: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_trains_an_ldlp_that_serves_generate(capfd, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": prompt + ". They played all day."}) + "\n"
                            for prompt in STORY_PROMPTS[:12]))
    out = tmp_path / "ldlp"
    args = ["train", "ldlp", "--target", STORIES, "--draft", HEAD, "--data", data, "--out", out,
            "--cache-dir", tmp_path / "cache", "--eval-samples", "4", "--gen-max-new-tokens", "16",
            "--epochs", "2", "--batch-size", "4", "--warmup-steps", "1", "--max-draft-length", "4"]
    code, stdout, err = run(capfd, *args)
    assert code == 0, err
    assert "fixed-4" in stdout and "oracle" in stdout
    assert json.loads((out / "evaluation.json").read_text())["max_draft_length"] == 4
    assert list((tmp_path / "cache").glob("ldlp-labels-*.pt"))
    code, _, err = run(capfd, *args, "--resume")  # labels and samples are reused
    assert code == 0 and "reusing LDLP labels" in err, err
    code, stdout, err = run(capfd, "generate", "--target", STORIES, "--method", "ada", "--draft", HEAD,
                            "--ldlp", out, "--ada-tree", "--prompt", "Once upon a time", "--max-new-tokens", "12",
                            "--dtype", "float32", "--json")
    assert code == 0, err
    assert json.loads(stdout)["new_tokens"] == 12


@pytest.mark.parametrize("args, message", [
    (["generate", "--target", STORIES, "--method", "ada", "--draft", HEAD, "--ldlp", HEAD / "absent", "--prompt",
      "Hi"], "no LDLP"),
    (["generate", "--target", STORIES, "--method", "ada", "--prompt", "Hi"], "needs --draft"),
    (["generate", "--target", STORIES, "--method", "eagle2", "--draft", HEAD, "--ldlp", HEAD, "--prompt", "Hi"],
     "only to method ada"),
    (["train", "ldlp", "--target", STORIES, "--draft", "/nowhere", "--data", HEAD / "config.json", "--out", "/tmp/x"],
     "not found"),
    (["train", "ldlp", "--target", STORIES, "--draft", HEAD, "--data", HEAD / "config.json", "--out", "/tmp/x",
      "--penalty", "0.5"], "--penalty"),
])
def test_bad_input_is_one_error_line(capfd, args, message):
    code, _, err = run(capfd, *args)
    assert code == 2 and message in one_error_line(err)
