"""EAGLE heads: checkpoint layout, static and dynamic draft trees, losslessness, training and resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import STORIES, STORY_PROMPTS

import specula
from specula.drafters.eagle import GPU_CHOICES, EagleDrafter
from specula.errors import SpeculaError
from specula.heads.eagle_head import EagleHead
from specula.runtime.plain_model import transformers_model
from specula.training.eagle_trainer import train_eagle
from specula.training.loop import TrainConfig


def test_checkpoint_round_trip_in_the_official_layout(stories_target, tmp_path):
    torch.manual_seed(0)
    head = EagleHead.for_target(stories_target.config, num_layers=2)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.1.input_layernorm.weight",
            "layers.0.post_attention_layernorm.weight", "layers.1.mlp.down_proj.weight"} <= keys
    assert "layers.0.input_layernorm.weight" not in keys  # layer 0 normalises nothing at its input
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2 and config["bias"] is True
    loaded = EagleHead.from_pretrained(tmp_path)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_a_multi_layer_head_reads_a_block_after_its_cache_causally(stories_target):
    """A block of pairs after a cached prefix (a drafter catching up on several tokens at once) predicts what
    feeding the pairs one by one predicts: no pair sees the ones after it, in any layer."""
    torch.manual_seed(2)
    head = EagleHead.for_target(stories_target.config, num_layers=2).attach(stories_target)
    features, embeds = torch.randn(7, 64), torch.randn(7, 64)
    positions = torch.arange(7)
    together = head.new_cache(16)
    head.step(features[:3], embeds[:3], positions[:3], together, None)
    together.commit()
    block = head.step(features[3:], embeds[3:], positions[3:], together, None)
    alone = head.new_cache(16)
    head.step(features[:3], embeds[:3], positions[:3], alone, None)
    alone.commit()
    one_by_one = []
    for i in range(3, 7):
        one_by_one.append(head.step(features[i:i + 1], embeds[i:i + 1], positions[i:i + 1], alone, None))
        alone.commit()
    torch.testing.assert_close(block, torch.cat(one_by_one), rtol=1e-5, atol=1e-5)


def test_top_tokens_are_the_best_of_the_log_probabilities(stories_target, eagle_head_dir):
    head = EagleHead.from_pretrained(eagle_head_dir).attach(stories_target)
    features = torch.randn(3, stories_target.config.hidden_size)
    for count in (1, 4):
        tokens, log_probs = head.top_tokens(features, count)
        expected = torch.topk(head.token_log_probs(features), count, dim=-1)
        assert torch.equal(tokens, expected.indices)
        torch.testing.assert_close(log_probs, expected.values)


def test_official_pytorch_bin_without_bias_key_loads(stories_target, tmp_path):
    torch.manual_seed(1)
    head = EagleHead.for_target(stories_target.config)
    state = {k: v for k, v in head.state_dict().items() if "rotary" not in k}
    state["embed_tokens.weight"] = torch.zeros(512, 64)  # some releases ship the embedding; it is ignored
    torch.save(state, tmp_path / "pytorch_model.bin")
    config = {k: v for k, v in head.config.items() if k != "bias"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = EagleHead.from_pretrained(tmp_path)
    assert loaded.config["bias"] is True
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)


def test_head_that_does_not_fit_the_target_is_refused(stories_target, tmp_path):
    from transformers import LlamaConfig

    other = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                        vocab_size=512)
    EagleHead.for_target(other).save_pretrained(tmp_path)
    with pytest.raises(SpeculaError, match="hidden size 32 .* 64"):
        specula.load(STORIES, method="eagle2", draft=tmp_path, dtype="float32")


def test_checkpoint_whose_tensors_disagree_with_config_is_refused(stories_target, tmp_path):
    EagleHead.for_target(stories_target.config).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 999
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculaError, match="shape"):
        EagleHead.from_pretrained(tmp_path)


def test_training_loss_falls(eagle_head_dir):
    history = json.loads((eagle_head_dir / "training_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
    evaluations = [h["eval"] for h in history if "eval" in h]
    assert evaluations and evaluations[-1]["0-alpha"] > evaluations[0]["0-alpha"]


@pytest.mark.parametrize(("method", "options"), [
    ("eagle", {}), ("eagle2", {}),  # the CPU defaults: one draft node
    ("eagle", {"choices": GPU_CHOICES}), ("eagle2", {"total_tokens": 8, "depth": 4, "top_k": 2})],
    ids=["eagle", "eagle2", "eagle-tree", "eagle2-tree"])
def test_greedy_output_equals_transformers_generate(method, options, eagle_head_dir):
    reference = specula.load(STORIES, method="vanilla", dtype="float32")
    speculator = specula.load(STORIES, method=method, draft=eagle_head_dir, dtype="float32", **options)
    accepted = 0
    for prompt in STORY_PROMPTS:
        ids = reference.encode(prompt)
        model = transformers_model(reference.target.model)
        expected = model.generate(ids[None], max_new_tokens=48, do_sample=False)[0, len(ids):]
        result = speculator.generate(prompt, max_new_tokens=48)
        assert result.token_ids == expected.tolist(), prompt
        accepted += sum(result.stats.accepted_lengths)
    assert accepted > 0, "the head never drafted an accepted token, so equality proved little"


def test_dynamic_tree_keeps_the_most_valuable_connected_nodes(stories_target, eagle_head_dir, monkeypatch):
    import specula.drafters.eagle as eagle

    head = EagleHead.from_pretrained(eagle_head_dir)
    drafter = EagleDrafter(stories_target, head, dynamic=True, total_tokens=12, depth=4, top_k=3)
    prompt = specula.load(STORIES, dtype="float32").encode(STORY_PROMPTS[0])
    out = stories_target.prefill(prompt, drafter.features)
    drafter.start(prompt, out)
    context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
    captured, masks = {}, []
    original_grow, original_assemble, original_step = drafter._grow, eagle.assemble, drafter.head.step

    def spy_grow(*args):
        captured["nodes"] = original_grow(*args)
        return captured["nodes"]

    def spy_assemble(*args):
        captured["levels"], captured["grown"] = args[2], original_assemble(*args)
        return captured["grown"]

    def spy_step(*args, **kwargs):
        if kwargs.get("own_features"):
            masks.append(args[4][0, 0])  # [rows, allocated]: what each fed pair attended to
        return original_step(*args, **kwargs)

    drafter._grow = spy_grow
    monkeypatch.setattr(eagle, "assemble", spy_assemble)
    monkeypatch.setattr(drafter.head, "step", spy_step)
    committed = len(context) - 1
    tree = drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None)
    nodes = captured["nodes"]
    assert len(tree) == 13 and len(nodes) == 12
    values, parents, depths = nodes.values.tolist(), nodes.parents.tolist(), nodes.depths.tolist()
    for i in range(len(nodes)):
        # Every kept node's ancestors are kept, and a parent is worth at least its child.
        if parents[i] >= 0:
            assert depths[parents[i]] == depths[i] - 1
            assert values[parents[i]] >= values[i]
        assert tree.depths[i + 1] == depths[i]
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path_to(i))
    # Each fed pair attended to every committed pair and to the pairs of its own ancestors and itself, no other:
    # level l feeds its frontier's 3 pairs at slots committed + 3 l + row.
    grown_parents = captured["grown"].parents.tolist()
    slot_of, layer_start = {}, 0
    assert len(masks) == len(captured["levels"]) == 3
    for level, ((frontier, *_), seen) in enumerate(zip(captured["levels"], masks, strict=True)):
        assert seen[:, :committed].all()
        for row, node in enumerate((layer_start + frontier.rows).tolist()):
            slot_of[node] = 3 * level + row
            lineage, ancestor = set(), node
            while ancestor >= 0:
                lineage.add(slot_of[ancestor])
                ancestor = grown_parents[ancestor]
            assert set((torch.nonzero(seen[row, committed:]).flatten()).tolist()) == lineage
        layer_start += 3 if level == 0 else 9
    assert drafter.cache.length == committed  # draft entries were discarded
    # Each node's confidence is the head's probability of its token given its parent: the products
    # along paths give back the node values (log of the path's confidence product).
    for i in range(len(nodes)):
        path = tree.path_to(i + 1)[1:]
        assert 0.0 < float(tree.confidences[i + 1]) <= 1.0
        assert abs(torch.log(tree.confidences[path]).sum().item() - values[i]) < 1e-4


def test_a_dynamic_tree_grows_no_deeper_than_its_confidence_floor(stories_target, eagle_head_dir):
    """min_confidence stops growth under a layer whose best path confidence is below it: a floor of 1 keeps the
    root's children alone, a floor between the layers' best confidences stops between them."""
    head = EagleHead.from_pretrained(eagle_head_dir)
    prompt = specula.load(STORIES, dtype="float32").encode(STORY_PROMPTS[0])
    trees = {}
    for floor in (0.0, 1.0):
        drafter = EagleDrafter(stories_target, head, dynamic=True, total_tokens=4, depth=4, top_k=1,
                               min_confidence=floor)
        out = stories_target.prefill(prompt, drafter.features)
        drafter.start(prompt, out)
        context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
        trees[floor] = drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None)
    assert trees[0.0].parents == [-1, 0, 1, 2, 3] and trees[1.0].parents == [-1, 0]
    path = torch.cumprod(trees[0.0].confidences[1:], 0)  # the chain's path confidences, depth 1..4
    between = float(path[1] + path[2]) / 2  # below depth 2's path, above depth 3's: growth stops after depth 3
    assert path[1] > path[2]
    drafter = EagleDrafter(stories_target, head, dynamic=True, total_tokens=4, depth=4, top_k=1, min_confidence=between)
    out = stories_target.prefill(prompt, drafter.features)
    drafter.start(prompt, out)
    tree = drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None)
    assert tree.parents == [-1, 0, 1, 2] and torch.equal(tree.tokens, trees[0.0].tokens[:4])


def test_a_confidence_floor_above_one_is_refused(eagle_head_dir):
    with pytest.raises(SpeculaError, match="min_confidence"):
        specula.load(STORIES, method="eagle2", draft=eagle_head_dir, dtype="float32", min_confidence=1.5)


@pytest.mark.parametrize("dynamic, shallow, deep", [
    (True, {"total_tokens": 3, "depth": 1, "top_k": 3}, {"total_tokens": 12, "depth": 2, "top_k": 3}),
    (False, {"choices": [[0], [1], [2]]}, {"choices": [[0], [1], [2], [0, 0], [1, 0]]})])
def test_a_one_level_greedy_tree_is_the_first_level_of_a_grown_one(stories_target, eagle_head_dir, dynamic,
                                                                    shallow, deep):
    """A depth-1 tree (the CPU default) skips the growth bookkeeping: it must be what growth keeps there."""
    head = EagleHead.from_pretrained(eagle_head_dir)
    prompt = specula.load(STORIES, dtype="float32").encode(STORY_PROMPTS[1])
    trees = []
    for options in (shallow, deep):
        drafter = EagleDrafter(stories_target, head, dynamic=dynamic, **options)
        stories_target.reset()
        out = stories_target.prefill(prompt, drafter.features)
        drafter.start(prompt, out)
        context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
        trees.append(drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None))
    one_level, grown = trees
    assert one_level.parents == [-1, 0, 0, 0] and grown.parents[:4] == [-1, 0, 0, 0] and len(grown) > 4
    assert torch.equal(one_level.tokens, grown.tokens[:4])
    torch.testing.assert_close(one_level.confidences, grown.confidences[:4])


def test_dynamic_tree_rerank_matches_brute_force_selection(stories_target, eagle_head_dir):
    """All expanded candidates are scored; the kept ones are exactly the total_tokens best."""
    head = EagleHead.from_pretrained(eagle_head_dir)
    drafter = EagleDrafter(stories_target, head, dynamic=True, total_tokens=7, depth=3, top_k=3)
    prompt = specula.load(STORIES, dtype="float32").encode(STORY_PROMPTS[3])
    out = stories_target.prefill(prompt, drafter.features)
    drafter.start(prompt, out)
    context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
    everything = {}
    from specula.drafters.eagle_growth import DraftedNodes

    original_subset = DraftedNodes.subset

    def spy(nodes, keep):
        everything["values"], everything["depths"] = nodes.values.tolist(), nodes.depths.tolist()
        everything["keep"] = keep.tolist()
        return original_subset(nodes, keep)

    DraftedNodes.subset = spy
    try:
        drafter.propose(context, max_depth=10, params=specula.SamplingParams(), generator=None)
    finally:
        DraftedNodes.subset = original_subset
    values, depths = everything["values"], everything["depths"]
    assert len(values) == 3 + 2 * 9  # top_k at depth 1, top_k * top_k at each later depth
    best = sorted(range(len(values)), key=lambda i: (-values[i], depths[i], i))[:7]
    assert sorted(everything["keep"]) == sorted(best)


def test_resumed_training_ends_with_the_same_weights(stories_target, stories_samples, tmp_path):
    config = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=3, save_every=3)
    train_eagle(stories_target, stories_samples[:12], [], tmp_path / "whole", config, log=lambda _: None)

    import specula.training.eagle_trainer as trainer

    original = trainer.eagle_loss
    calls = {"n": 0}

    def interrupted_loss(target, noise=0.1):
        inner = original(target, noise)

        def loss_fn(head, batch):
            calls["n"] += 1
            if calls["n"] == 5:  # after the checkpoint at step 3
                raise KeyboardInterrupt
            return inner(head, batch)

        return loss_fn

    trainer.eagle_loss = interrupted_loss
    try:
        with pytest.raises(KeyboardInterrupt):
            train_eagle(stories_target, stories_samples[:12], [], tmp_path / "split", config, log=lambda _: None)
    finally:
        trainer.eagle_loss = original
    train_eagle(stories_target, stories_samples[:12], [], tmp_path / "split", config, resume=True,
                log=lambda _: None)
    whole = EagleHead.from_pretrained(tmp_path / "whole")
    split = EagleHead.from_pretrained(tmp_path / "split")
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(split.state_dict()[name], tensor, rtol=0, atol=0)


def test_fine_tuning_starts_from_the_given_head(stories_target, stories_samples, eagle_head_dir, tmp_path, capfd):
    from specula.cli import main
    from specula.training.eagle_trainer import EagleTrainOptions, train_eagle
    from specula.training.loop import TrainConfig

    EagleHead.from_pretrained(eagle_head_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "start")
    # A learning rate so small that the weights cannot move visibly: what comes out is what went in.
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-12, warmup_steps=1, save_every=1000)
    train_eagle(stories_target, stories_samples[:8], stories_samples[16:18], tmp_path / "tuned", config,
                EagleTrainOptions(init=tmp_path / "start"), log=lambda _: None)
    start, tuned = EagleHead.from_pretrained(tmp_path / "start"), EagleHead.from_pretrained(tmp_path / "tuned")
    for (name, value), (_, expected) in zip(tuned.state_dict().items(), start.state_dict().items(), strict=True):
        torch.testing.assert_close(value.float(), expected.float(), atol=1e-6, rtol=0, msg=name)
    # Another number of layers is refused, by the API and, before the target loads, by the command.
    with pytest.raises(SpeculaError, match="--num-layers 2 differs from the --init head's 1"):
        train_eagle(stories_target, stories_samples[:8], [], tmp_path / "other", config,
                    EagleTrainOptions(num_layers=2, init=tmp_path / "start"), log=lambda _: None)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time."}) + "\n")
    capfd.readouterr()  # the progress bars of the runs above
    assert main(["train", "eagle", "--target", str(STORIES), "--data", str(data), "--out", str(tmp_path / "cli"),
                 "--init", str(tmp_path / "start"), "--num-layers", "2"]) == 2
    err = capfd.readouterr().err
    assert "--num-layers 2 differs" in err and len(err.strip().splitlines()) == 1, err
