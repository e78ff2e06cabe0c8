"""Medusa heads: published layout, tree alignment and shape, losslessness (and typical acceptance's lack of it),
training, tree building and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import test_lossless_sampling as lossless
import torch
import torch.nn.functional as F
from conftest import STORIES, STORY_PROMPTS

import specula
from specula.acceptance import Acceptor
from specula.acceptance_typical import TypicalAcceptor, make_acceptor
from specula.api import Speculator
from specula.cli import build_parser
from specula.decoding import generate_tokens
from specula.drafters.medusa import (
    CHOICES_FILE,
    MedusaDrafter,
    build_medusa_drafter,
    check_choices,
    default_choices,
)
from specula.errors import SpeculaError
from specula.heads.medusa_head import MedusaHeads
from specula.kernels import q4_1
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import FeatureRequest, Target
from specula.sampling import SamplingParams
from specula.training.loop import TrainConfig
from specula.training.medusa_trainer import MedusaTrainOptions, train_medusa
from specula.training.medusa_tree import build_choices, expected_accepted
from specula.tree import DraftTree

# Tiny tensors: intra-op threads only add overhead and contention on a shared machine.
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def trained_heads_dir(stories_target, stories_samples, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("medusa_heads")
    config = TrainConfig(epochs=12, batch_size=4, lr=3e-2, warmup_steps=5, save_every=1000)
    train_medusa(stories_target, stories_samples[:16], stories_samples[16:], out, config,
                 MedusaTrainOptions(num_heads=3), log=lambda _: None)
    return out


def medusa_speculator(target: Target, heads_dir: Path, **options) -> Speculator:
    return Speculator(target, "medusa", build_medusa_drafter(target, heads_dir, **options))


# ---------------------------------------------------------------- heads and the published layout


def test_heads_compute_the_paper_formula(stories_target):
    torch.manual_seed(0)
    heads = MedusaHeads(64, 512, num_heads=2, num_layers=1)
    h = torch.randn(3, 64)
    for k in range(2):
        w1, b1 = heads.medusa_head[k][0].linear.weight, heads.medusa_head[k][0].linear.bias
        w2 = heads.medusa_head[k][1].weight
        expected = (F.silu(h @ w1.T + b1) + h) @ w2.T  # softmax(W2 · (SiLU(W1 · h) + h)) before the softmax
        torch.testing.assert_close(heads(h)[k], expected)
    # A fresh head for a target starts as its LM head: blocks are the identity.
    fresh = MedusaHeads.for_target(stories_target, num_heads=2)
    lm_logits = stories_target.model.lm_head(h)
    torch.testing.assert_close(fresh(h), torch.stack([lm_logits, lm_logits]))


def test_round_trip_in_the_published_layout(tmp_path):
    torch.manual_seed(1)
    heads = MedusaHeads(64, 512, num_heads=3, num_layers=2, base_model_name_or_path="stories260k")
    for weights in ("safetensors", "pt"):
        directory = tmp_path / weights
        heads.save_pretrained(directory, weights=weights)
        file = directory / f"medusa_lm_head.{weights}"
        if weights == "safetensors":
            from safetensors.torch import load_file

            keys = set(load_file(str(file)))
        else:
            keys = set(torch.load(file, weights_only=True))
        assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.linear.weight", "0.2.weight", "2.2.weight"} <= keys
        assert len(keys) == 3 * (2 * 2 + 1)
        config = json.loads((directory / "config.json").read_text())
        assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
        assert config["base_model_name_or_path"] == "stories260k"
        loaded = MedusaHeads.from_pretrained(directory)
        assert (loaded.num_heads, loaded.num_layers) == (3, 2)
        for name, tensor in heads.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    # Saving in the other format replaces the weights instead of leaving a stale file that would shadow them.
    heads.save_pretrained(tmp_path / "pt", weights="safetensors")
    assert sorted(f.name for f in (tmp_path / "pt").iterdir()) == ["config.json", "medusa_lm_head.safetensors"]


def test_heads_sharing_the_lm_head_store_only_their_blocks_and_project_through_the_target(stories_target, tmp_path):
    torch.manual_seed(2)
    heads = MedusaHeads.for_target(stories_target, num_heads=2, num_layers=1, shared_lm_head=True)
    h = torch.randn(3, stories_target.config.hidden_size)
    lm_logits = stories_target.model.lm_head(h)
    torch.testing.assert_close(heads(h), torch.stack([lm_logits, lm_logits]))  # fresh: blocks are the identity
    for block in (heads.medusa_head[0][0], heads.medusa_head[1][0]):
        torch.nn.init.normal_(block.linear.weight, std=0.1)
    w1, b1 = heads.medusa_head[1][0].linear.weight, heads.medusa_head[1][0].linear.bias
    torch.testing.assert_close(heads(h)[1], stories_target.model.lm_head(F.silu(h @ w1.T + b1) + h))
    heads.save_pretrained(tmp_path / "shared")
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "shared" / "medusa_lm_head.safetensors"))) == {
        "0.0.linear.weight", "0.0.linear.bias", "1.0.linear.weight", "1.0.linear.bias"}
    assert json.loads((tmp_path / "shared" / "config.json").read_text())["medusa_shared_lm_head"] is True
    loaded = MedusaHeads.from_pretrained(tmp_path / "shared")
    with pytest.raises(RuntimeError, match="attach"):
        loaded(h)  # the LM head is the target's: nothing to project through before attach
    torch.testing.assert_close(loaded.attach(stories_target)(h), heads(h), rtol=0, atol=0)
    assert medusa_speculator(stories_target, tmp_path / "shared").generate("Once upon a time", max_new_tokens=8)


def test_shared_lm_head_training_keeps_the_target_frozen_and_greedy_output_exact(stories_target, stories_samples,
                                                                                 tmp_path):
    before = stories_target.model.lm_head.weight.clone()
    config = TrainConfig(epochs=3, batch_size=4, lr=3e-2, warmup_steps=2, save_every=1000)
    train_medusa(stories_target, stories_samples[:16], stories_samples[16:], tmp_path, config,
                 MedusaTrainOptions(num_heads=2, shared_lm_head=True), log=lambda _: None)
    assert torch.equal(stories_target.model.lm_head.weight, before)
    history = json.loads((tmp_path / "training_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < losses[0]
    reference = specula.load(STORIES, method="vanilla", dtype="float32")
    speculator = medusa_speculator(stories_target, tmp_path)
    for prompt in STORY_PROMPTS[:3]:
        assert speculator.generate(prompt, max_new_tokens=24).token_ids == reference.generate(
            prompt, max_new_tokens=24).token_ids


def test_published_checkpoint_with_a_wrong_head_count_loads(tmp_path):
    """Released Medusa configs say 2 heads for weights holding more: the tensors decide, as in the original."""
    torch.manual_seed(2)
    heads = MedusaHeads(64, 512, num_heads=4, num_layers=1).half()
    torch.save(heads.medusa_head.state_dict(), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
         "transformers_version": "4.33.1"}))
    loaded = MedusaHeads.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.num_heads == 4 and loaded.medusa_head[3][1].weight.dtype == torch.float32
    torch.testing.assert_close(loaded.medusa_head[3][1].weight, heads.medusa_head[3][1].weight.float())
    # A whole-model checkpoint: head tensors under the module prefix, base-model tensors beside them.
    from safetensors.torch import save_file

    whole = tmp_path / "whole"
    whole.mkdir()
    state = {f"medusa_head.{k}": v.contiguous() for k, v in heads.medusa_head.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(512, 64, dtype=torch.float16)
    state["lm_head.weight"] = torch.zeros(512, 64, dtype=torch.float16)
    save_file(state, str(whole / "model.safetensors"))
    assert MedusaHeads.from_pretrained(whole).num_heads == 4  # no config.json at all: the tensors suffice


def _saved_state(tmp_path: Path) -> tuple[Path, dict]:
    MedusaHeads(64, 512, num_heads=2, num_layers=1).save_pretrained(tmp_path)
    from safetensors.torch import load_file

    return tmp_path / "medusa_lm_head.safetensors", load_file(str(tmp_path / "medusa_lm_head.safetensors"))


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("1.0.linear.bias"), "lacks 1.0.linear"),
    (lambda s: s.update({"3.1.weight": s["1.1.weight"].clone()}), r"lacks the tensors of Medusa heads \[2\]"),
    (lambda s: s.pop("1.1.weight"), "no vocabulary projection"),
    (lambda s: s.update({"extra.weight": torch.zeros(1)}), "not Medusa head tensors"),
    (lambda s: s.update({"1.1.weight": torch.zeros(512, 32)}), "shape"),
    (lambda s: s.clear(), "no Medusa head tensors"),
])
def test_damaged_checkpoints_are_refused(tmp_path, damage, message):
    from safetensors.torch import save_file

    file, state = _saved_state(tmp_path)
    damage(state)
    save_file(state, str(file))
    with pytest.raises(SpeculaError, match=message):
        MedusaHeads.from_pretrained(tmp_path)


def test_config_disagreeing_with_the_tensor_shapes_is_refused(tmp_path):
    _saved_state(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_size=128)))
    with pytest.raises(SpeculaError, match="hidden_size 64 but its config says 128"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpeculaError, match="not valid JSON"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(SpeculaError, match="no Medusa weights"):
        MedusaHeads.from_pretrained(tmp_path)
    with pytest.raises(SpeculaError, match="not found"):
        MedusaHeads.from_pretrained(tmp_path / "absent")


def test_heads_or_trees_that_do_not_fit_are_refused(stories_target, tmp_path):
    MedusaHeads(32, 512, num_heads=2).save_pretrained(tmp_path / "narrow")
    with pytest.raises(SpeculaError, match="hidden size 32 do not fit the target's 64"):
        build_medusa_drafter(stories_target, tmp_path / "narrow")
    MedusaHeads(64, 500, num_heads=2).save_pretrained(tmp_path / "small")
    with pytest.raises(SpeculaError, match="vocabulary 500 does not fit the target's 512"):
        build_medusa_drafter(stories_target, tmp_path / "small")
    MedusaHeads(64, 512, num_heads=2).save_pretrained(tmp_path / "fits")
    with pytest.raises(SpeculaError, match="3 deep but there are only 2 heads"):
        build_medusa_drafter(stories_target, tmp_path / "fits", choices=[[0], [0, 0], [0, 0, 0]])
    with pytest.raises(SpeculaError, match="lack their parent"):
        build_medusa_drafter(stories_target, tmp_path / "fits", choices=[[0], [1, 0]])
    with pytest.raises(SpeculaError, match="--tree-total-tokens does not apply"):
        build_medusa_drafter(stories_target, tmp_path / "fits", total_tokens=10)
    with pytest.raises(SpeculaError, match="needs --draft"):
        build_medusa_drafter(stories_target, None)
    # Heads without a tree file get the device's default tree, cut to the heads at hand: one node on a CPU.
    assert build_medusa_drafter(stories_target, tmp_path / "fits").choices == [[0]]
    assert max(map(len, default_choices("cuda", 2))) == 2 and len(default_choices("cuda", 4)) == 15


# ---------------------------------------------------------------- tree shape and alignment


def test_tree_holds_head_k_candidates_at_depth_k(stories_target, trained_heads_dir):
    heads = MedusaHeads.from_pretrained(trained_heads_dir)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = MedusaDrafter(stories_target, heads, choices)
    prompt = specula.load(STORIES, dtype="float32").encode(STORY_PROMPTS[2])
    out = stories_target.prefill(prompt, drafter.features)
    drafter.start(prompt, out)
    root = int(out.logits[-1].argmax())
    tree = drafter.propose(torch.cat([prompt, torch.tensor([root])]), 10, SamplingParams(), None)
    # The hidden state of the last prompt token gave the root through the LM head; head k reads it for depth k.
    ranked = heads(out.hidden[-1]).topk(2, dim=-1).indices
    assert tree.tokens.tolist() == [root, *[int(ranked[len(p) - 1, p[-1]]) for p in choices]]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.draft_probs is None  # deterministic candidates: point-mass proposals
    assert len(drafter.propose(torch.tensor([root]), 1, SamplingParams(), None)) == 3  # cut to max_depth
    # After verification the drafter reads the row of the last accepted node.
    verified = stories_target.forward(tree.tokens, tree.ancestor_mask(), tree.depths, drafter.features)
    drafter.observe(tree.tokens[[0, 1, 3]], verified.select([0, 1, 3]))
    torch.testing.assert_close(drafter.hidden, verified.hidden[3])


def test_build_choices_keeps_the_most_probable_connected_paths():
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.3, 0.05], [0.4, 0.1, 0.0]])
    choices = build_choices(accuracy, 6)
    assert choices == [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]
    # Brute force: these are the 6 most probable of all paths, and their expected accepted length is the best.
    everything = [[a] for a in range(3)] + [[a, b] for a in range(3) for b in range(3)] + [
        [a, b, c] for a in range(3) for b in range(3) for c in range(3)]
    best = sorted(everything, key=lambda p: -expected_accepted([p], accuracy))[:6]
    assert expected_accepted(choices, accuracy) == pytest.approx(expected_accepted(best, accuracy))
    assert check_choices(choices) == choices  # connected, in depth order
    with pytest.raises(SpeculaError):
        build_choices(accuracy, 0)


# ---------------------------------------------------------------- training


def test_training_loss_falls_and_writes_a_tree(trained_heads_dir):
    history = json.loads((trained_heads_dir / "training_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert sum(losses[-4:]) / 4 < 0.3 * sum(losses[:4]) / 4
    evaluations = [h["eval"] for h in history if "eval" in h]
    assert evaluations[-1]["head1_top1"] > evaluations[0]["head1_top1"]
    tree = json.loads((trained_heads_dir / CHOICES_FILE).read_text())
    assert len(tree["choices"]) == 15 and len(tree["accuracy"]) == 3
    assert check_choices(tree["choices"], num_heads=3) == tree["choices"]


def test_loss_targets_token_k_plus_1_ahead_of_the_hidden_state():
    from specula.training.medusa_trainer import head_targets

    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    response = torch.tensor([[False, False, True, True, True, True]])
    mask, tokens = head_targets(ids, torch.ones_like(response), response, num_heads=2)
    # Head 1 at position i predicts t_{i+2}; head 2 predicts t_{i+3}; only response tokens are targets.
    assert mask[0, 0].tolist() == [True, True, True, True, False, False]
    assert tokens[0, 0, :4].tolist() == [12, 13, 14, 15]
    assert mask[1, 0].tolist() == [True, True, True, False, False, False]
    assert tokens[1, 0, :3].tolist() == [13, 14, 15]
    # A prompt token is never a target: with the response starting at t_3, head 1 skips position 0.
    response[0, 2] = False
    mask, _ = head_targets(ids, torch.ones_like(response), response, num_heads=2)
    assert mask[0, 0].tolist() == [False, True, True, True, False, False]


# ---------------------------------------------------------------- greedy equality


def test_greedy_output_equals_transformers_generate(stories_target, trained_heads_dir):
    reference = specula.load(STORIES, method="vanilla", dtype="float32")
    speculator = medusa_speculator(stories_target, trained_heads_dir)
    typical = TypicalAcceptor()
    accepted = cycles = 0
    for prompt in STORY_PROMPTS[::3]:
        ids = reference.encode(prompt)
        model = transformers_model(reference.target.model)
        expected = model.generate(ids[None], max_new_tokens=40, do_sample=False)[0, len(ids):]
        result = speculator.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected.tolist(), prompt
        accepted += sum(result.stats.accepted_lengths)
        cycles += len(result.stats.accepted_lengths)
        # Typical acceptance is greedy matching at temperature 0, as in Medusa.
        tokens, _ = generate_tokens(stories_target, speculator.drafter, ids, 40, SamplingParams(), acceptor=typical)
        assert tokens == expected.tolist(), prompt
    # Far more than chance: heads misaligned by one position would hardly ever be accepted.
    assert accepted > 0.5 * cycles, (accepted, cycles)


# ---------------------------------------------------------------- temperature > 0: lossless, and typical is not

# The end-to-end chi-square machinery of test_lossless_sampling.py (T=1, top_k=5, 4 new tokens, exact joint of
# 625 outcomes, ALPHA = 1e-3). On this prompt the trained heads' candidates are accepted about once per run under
# the lossless rule; typical acceptance moves the marginals of tokens 2-4 so far that their p-values fall below 1e-100.
PROMPT = "A friendly dragon lived on a hill"


def fit_pvalues(target: Target, drafter, acceptor) -> tuple[dict[str, float], int]:
    """p-values of the joint and of each speculative position's marginal, and the drafts accepted in all."""
    prompt = lossless.encode(target, PROMPT)
    exact = lossless.exact_sequence_distribution(target, prompt, lossless.E2E_PARAMS, lossless.E2E_NEW_TOKENS)
    counts, accepted = lossless.run_generation(target, drafter, prompt, acceptor)
    return lossless.fit_pvalues(counts, exact, lossless.E2E_NEW_TOKENS), accepted


def test_sampling_with_medusa_matches_the_target_distribution(stories_target, trained_heads_dir):
    drafter = build_medusa_drafter(stories_target, trained_heads_dir)
    assert Acceptor.lossless
    pvalues, accepted = fit_pvalues(stories_target, drafter, Acceptor())
    assert accepted > lossless.N_E2E // 2, accepted  # speculation happened: about one accepted draft per run
    assert min(pvalues.values()) >= lossless.ALPHA, pvalues


def test_typical_acceptance_is_not_lossless(stories_target, trained_heads_dir):
    drafter = build_medusa_drafter(stories_target, trained_heads_dir)
    assert TypicalAcceptor.lossless is False
    pvalues, _ = fit_pvalues(stories_target, drafter, TypicalAcceptor())
    assert min(pvalues.values()) < lossless.ALPHA, pvalues


def test_typical_acceptance_keeps_the_deepest_typical_path():
    # Root 0 with children 1 and 2; node 1 has child 3. Target rows: after the root p = (.., 0.5 on 1, 0.45 on 2);
    # after node 1 token 3 has probability 0.02, below min(0.09, 0.3 e^-H).
    logits = torch.full((4, 6), -30.0)
    logits[0, 1], logits[0, 2], logits[0, 5] = np.log(0.5), np.log(0.45), np.log(0.05)
    logits[1, 3], logits[1, 4] = np.log(0.02), np.log(0.98)
    logits[2, 4] = 0.0
    tree = DraftTree(torch.tensor([0, 1, 2, 3]), [-1, 0, 0, 1])
    generator = torch.Generator().manual_seed(0)
    result = TypicalAcceptor()(tree, logits, SamplingParams(temperature=1.0), generator)
    assert result.accepted_nodes == [0, 1] and result.next_token == 4
    # Both children pass at the root; with node 3 typical too, the deeper path wins.
    logits[1, 3], logits[1, 4] = np.log(0.5), np.log(0.5)
    assert TypicalAcceptor()(tree, logits, SamplingParams(temperature=1.0), generator).accepted_nodes == [0, 1, 3]
    with pytest.raises(SpeculaError):
        TypicalAcceptor(posterior_threshold=0.0)
    assert make_acceptor("lossless").lossless and not make_acceptor("typical").lossless
    with pytest.raises(SpeculaError, match="unknown acceptance"):
        make_acceptor("fast")



@pytest.mark.parametrize("shared_lm_head", [False, True])
def test_heads_train_on_a_quantized_target_in_either_layout(stories_samples, tmp_path, shared_lm_head):
    """Users run q4_1, so heads learn from features that model wrote. Fresh heads once could not start there (its
    LM head has no float weight to copy), and heads sharing its LM head got no gradient through the kernel: their
    blocks stayed the identity while the loss looked finite."""
    weights = "q4_1" if q4_1.unavailable_reason() is None else "int4"
    target = Target.load(STORIES, dtype="float32", weights=weights)
    request = FeatureRequest(final_hidden=True)
    samples = [{**s, "hidden": target.prefill(s["input_ids"], request).hidden} for s in stories_samples]
    config = TrainConfig(epochs=3, batch_size=4, lr=3e-2, warmup_steps=2, save_every=1000)
    train_medusa(target, samples[:16], samples[16:], tmp_path, config,
                 MedusaTrainOptions(num_heads=2, shared_lm_head=shared_lm_head), log=lambda _: None)
    losses = [h["loss"] for h in json.loads((tmp_path / "training_history.json").read_text()) if "loss" in h]
    assert losses[-1] < losses[0]
    heads = MedusaHeads.from_pretrained(tmp_path)
    blocks = [p for name, p in heads.named_parameters() if "linear" in name]
    assert blocks and all(p.abs().sum() > 0 for p in blocks)  # moved away from the identity they start as

def test_fine_tuning_starts_from_the_given_heads(stories_target, stories_samples, tmp_path, capfd):
    from specula.cli import main

    heads = MedusaHeads.for_target(stories_target, num_heads=2, num_layers=1, shared_lm_head=True)
    with torch.no_grad():  # blocks that are not the identity, so a fresh start would show
        for parameter in heads.parameters():
            parameter.normal_(0, 0.02)
    heads.to(torch.bfloat16).save_pretrained(tmp_path / "start")
    # A learning rate so small that the weights cannot move visibly: what comes out is what went in, in the
    # --init heads' shape and layout, though the options name neither.
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-12, warmup_steps=1, save_every=1000)
    train_medusa(stories_target, stories_samples[:8], stories_samples[16:18], tmp_path / "tuned", config,
                 MedusaTrainOptions(init=tmp_path / "start"), log=lambda _: None)
    start, tuned = MedusaHeads.from_pretrained(tmp_path / "start"), MedusaHeads.from_pretrained(tmp_path / "tuned")
    assert (tuned.num_heads, tuned.num_layers, tuned.shared_lm_head) == (2, 1, True)
    for (name, value), (_, expected) in zip(tuned.state_dict().items(), start.state_dict().items(), strict=True):
        torch.testing.assert_close(value.float(), expected.float(), atol=1e-6, rtol=0, msg=name)
    # Another shape is refused, by the API and, before the target loads, by the command.
    with pytest.raises(SpeculaError, match="--num-heads 3 differs from the --init heads' 2"):
        train_medusa(stories_target, stories_samples[:8], [], tmp_path / "other", config,
                     MedusaTrainOptions(num_heads=3, init=tmp_path / "start"), log=lambda _: None)
    MedusaHeads(64, 512, num_heads=2).save_pretrained(tmp_path / "own")
    with pytest.raises(SpeculaError, match="--shared-lm-head asks for heads that share"):
        train_medusa(stories_target, stories_samples[:8], [], tmp_path / "other", config,
                     MedusaTrainOptions(shared_lm_head=True, init=tmp_path / "own"), log=lambda _: None)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time."}) + "\n")
    capfd.readouterr()  # the progress bars of the runs above
    for flags, message in ((["--num-layers", "2"], "--num-layers 2 differs"),
                           (["--num-heads", "1"], "--num-heads 1 differs")):
        assert main(["train", "medusa", "--target", str(STORIES), "--data", str(data), "--out",
                     str(tmp_path / "cli"), "--init", str(tmp_path / "start"), *flags]) == 2
        err = capfd.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cli").exists()


# ---------------------------------------------------------------- command line


def cli(*args: str) -> int:
    parsed = build_parser().parse_args(["train", *map(str, args)])
    return parsed.handler(parsed)


def test_train_and_tree_commands(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in STORY_PROMPTS[:10]))
    out = tmp_path / "heads"
    assert cli("medusa", "--target", STORIES, "--data", data, "--out", out, "--epochs", "1", "--batch-size", "4",
               "--eval-samples", "2", "--gen-max-new-tokens", "12", "--warmup-steps", "1", "--num-heads", "2",
               "--tree-nodes", "5") == 0
    assert MedusaHeads.from_pretrained(out).num_heads == 2
    assert len(json.loads((out / CHOICES_FILE).read_text())["choices"]) == 5
    capsys.readouterr()
    assert cli("medusa-tree", "--target", STORIES, "--draft", out, "--data", data, "--nodes", "7", "--samples", "4",
               "--gen-max-new-tokens", "12", "--out", tmp_path / "tree.json") == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["choices"]) == 7 and report["measured_on_samples"] == 4
    assert build_medusa_drafter(specula.load(STORIES, dtype="float32").target, out).choices == check_choices(
        json.loads((out / CHOICES_FILE).read_text())["choices"])
    with pytest.raises(SpeculaError, match="not found"):
        cli("medusa-tree", "--target", STORIES, "--draft", out, "--data", tmp_path / "absent.jsonl")
    with pytest.raises(SpeculaError, match="decay"):
        cli("medusa", "--target", STORIES, "--data", data, "--out", out, "--decay", "0")
    with pytest.raises(SpeculaError):
        cli("medusa-tree", "--target", STORIES, "--draft", out, "--data", data, "--nodes", "0")
