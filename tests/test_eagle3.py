"""EAGLE-3 heads: training-time-test attention, draft vocabulary, official layout, losslessness, training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import STORIES, STORY_LAYERS, STORY_PROMPTS

import specula
from specula.errors import SpeculaError
from specula.heads.eagle3_head import Eagle3Head, default_feature_layers, dense_ttt_attention, ttt_attention
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import FeatureRequest
from specula.training.eagle3_trainer import choose_draft_vocab, soft_cross_entropy


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_equals_dense_masked_reference(steps):
    generator = torch.Generator().manual_seed(steps)
    batch, heads, length, dim = 2, 3, 7, 5
    q = torch.randn(batch, heads, length, dim, generator=generator)
    keys = [torch.randn(batch, heads, length, dim, generator=generator) for _ in range(steps)]
    values = [torch.randn(batch, heads, length, dim, generator=generator) for _ in range(steps)]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    torch.testing.assert_close(ttt_attention(q, keys, values, causal, 0.4),
                               dense_ttt_attention(q, keys, values, causal, 0.4))


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_steps_match_drafting_the_same_chain(stories_target, layers):
    """Step i of training-time test at slot j equals the head drafting i tokens past j with a cache."""
    torch.manual_seed(0)
    head = Eagle3Head.for_target(stories_target.config, feature_layers=list(STORY_LAYERS), num_layers=layers).eval()
    length, steps = 6, 3
    features = torch.randn(1, length, 3 * 64)
    tokens = torch.randint(0, 512, (length + steps + 1,))
    embed = stories_target.model.get_input_embeddings()
    step_embeds = [embed(tokens[1 + i: 1 + i + length])[None] for i in range(steps)]
    with torch.no_grad():
        outputs = head(features, step_embeds)
    slot = 3
    cache = head.new_cache(32)
    out = head.step(features[0, : slot + 1], step_embeds[0][0, : slot + 1], torch.arange(slot + 1), cache, None)
    cache.commit()
    torch.testing.assert_close(out[-1], outputs[0][0, slot], atol=1e-5, rtol=1e-4)
    hidden = out[-1:]
    for i in range(1, steps):
        hidden = head.step(hidden, step_embeds[i][0, slot: slot + 1], torch.tensor([slot + i]), cache, None,
                           own_features=True)
        cache.commit()
        torch.testing.assert_close(hidden[0], outputs[i][0, slot], atol=1e-5, rtol=1e-4)


def test_draft_vocabulary_is_the_most_frequent_response_tokens():
    dataset = [{"input_ids": torch.tensor([5, 1, 1, 3, 3, 3, 7]),
                "loss_mask": torch.tensor([False, True, True, True, True, True, True])}]
    ids, coverage = choose_draft_vocab(dataset, vocab_size=10, draft_vocab_size=3)
    assert ids.tolist() == [1, 3, 7]  # 5 is a prompt token and does not count
    assert coverage == 1.0
    ids, coverage = choose_draft_vocab(dataset, vocab_size=10, draft_vocab_size=2)
    assert ids.tolist() == [1, 3] and math.isclose(coverage, 5 / 6)
    with pytest.raises(SpeculaError, match="draft vocabulary size"):
        choose_draft_vocab(dataset, vocab_size=10, draft_vocab_size=11)


def test_draft_vocabulary_mapping_round_trip(stories_target):
    draft_vocab = torch.tensor([3, 9, 10, 200, 511])
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=draft_vocab, feature_layers=list(STORY_LAYERS))
    assert head.draft_to_target(torch.arange(5)).tolist() == draft_vocab.tolist()
    assert head.t2d.nonzero().flatten().tolist() == draft_vocab.tolist()
    log_probs = head.token_log_probs(torch.randn(2, 64))
    assert log_probs.shape == (2, 512)
    outside = torch.ones(512, dtype=torch.bool)
    outside[draft_vocab] = False
    assert torch.isinf(log_probs[:, outside]).all()
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2))


@pytest.mark.parametrize("count", [1, 3])
def test_top_tokens_are_the_best_of_the_log_probabilities_in_target_ids(stories_target, count):
    """Greedy drafting reads the draft vocabulary's top tokens directly: the same tokens and log-probabilities
    as ranking the whole target-vocabulary row."""
    torch.manual_seed(1)
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=torch.tensor([3, 9, 10, 200, 511]),
                                 feature_layers=list(STORY_LAYERS))
    features = torch.randn(4, 64)
    tokens, log_probs = head.top_tokens(features, count)
    expected = torch.topk(head.token_log_probs(features), count, dim=-1)
    assert torch.equal(tokens, expected.indices)
    torch.testing.assert_close(log_probs, expected.values)


def test_drafted_logits_are_the_draft_vocabulary_rows_of_the_log_probabilities(stories_target):
    """Sampled drafts are drawn over the draft vocabulary: its logits, widened, give `token_log_probs`."""
    draft_vocab = torch.tensor([3, 9, 10, 200, 511])
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=draft_vocab, feature_layers=list(STORY_LAYERS))
    features = torch.randn(3, 64)
    logits, ids = head.drafted_logits(features)
    assert logits.shape == (3, 5) and ids.tolist() == draft_vocab.tolist()
    torch.testing.assert_close(torch.log_softmax(logits, -1), head.token_log_probs(features)[:, ids])
    head.set_draft_vocab(torch.tensor([1, 2, 3, 4, 5]))  # the ids follow a changed vocabulary
    assert head.drafted_logits(features)[1].tolist() == [1, 2, 3, 4, 5]
    logits, ids = Eagle3Head.for_target(stories_target.config).drafted_logits(features)
    assert ids is None and logits.shape == (3, 512)


def test_the_chunked_training_loss_equals_the_whole_one_with_the_same_gradients(stories_target):
    """The loss over draft logits is computed a few rows at a time (memory); value, agreement and gradients are
    those of the whole [N, Vd] computation."""
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=torch.arange(0, 512, 3),
                                 feature_layers=list(STORY_LAYERS))
    outputs = torch.randn(11, 64, requires_grad=True)
    wanted = torch.softmax(torch.randn(11, head.draft_vocab_size), -1)
    whole_log_probs = torch.log_softmax(head.draft_logits(outputs).float(), -1)
    whole = -(wanted * whole_log_probs).sum()
    whole_grads = torch.autograd.grad(whole, [outputs, head.lm_head.weight])
    chunked, agree = soft_cross_entropy(head, outputs, wanted, chunk=4)
    chunked_grads = torch.autograd.grad(chunked, [outputs, head.lm_head.weight])
    torch.testing.assert_close(chunked, whole)
    assert agree.tolist() == (whole_log_probs.argmax(-1) == wanted.argmax(-1)).tolist()
    for got, expected in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(got, expected)
    # the captured top-k kept sparse (draft ids, probabilities, most probable first) is the same loss as its dense rows
    probs = torch.softmax(torch.randn(11, 5), -1).sort(-1, descending=True).values
    ids = torch.randperm(head.draft_vocab_size)[:55].view(11, 5)
    dense = torch.zeros(11, head.draft_vocab_size).scatter_(-1, ids, probs)
    (sparse_loss, sparse_agree), (dense_loss, dense_agree) = (soft_cross_entropy(head, outputs, ids, probs, chunk=4),
                                                              soft_cross_entropy(head, outputs, dense))
    torch.testing.assert_close(sparse_loss, dense_loss)
    assert sparse_agree.tolist() == dense_agree.tolist()


def test_full_vocabulary_head_has_no_mapping(stories_target):
    head = Eagle3Head.for_target(stories_target.config)
    assert head.d2t is None and head.t2d is None
    assert head.feature_layers == default_feature_layers(5) == [2, 2, 2]
    assert head.feature_request() == FeatureRequest(final_hidden=False, layer_inputs=(2,))


def test_checkpoint_round_trip_in_the_official_layout(stories_target, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=torch.arange(0, 512, 2))
    head.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == {
        "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
        "lm_head.weight", "d2t", "t2d"}
    assert tensors["fc.weight"].shape == (64, 192) and tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    assert tensors["lm_head.weight"].shape == (256, 64) and tensors["d2t"].dtype == torch.int64
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = Eagle3Head.from_pretrained(tmp_path)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_a_two_layer_head_round_trips_decodes_like_transformers_and_is_not_exported(stories_target, tmp_path):
    """A second decoder layer (`layers.1.*`) is saved, loaded and drafted with; greedy output stays the target's."""
    from specula.gguf.heads import TargetInfo, check_expressible

    torch.manual_seed(0)
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=torch.arange(0, 512, 2),
                                 feature_layers=list(STORY_LAYERS), num_layers=2)
    head.save_pretrained(tmp_path / "head")
    loaded = Eagle3Head.from_pretrained(tmp_path / "head")
    assert len(loaded.layers) == 1 and "layers.1.self_attn.q_proj.weight" in loaded.state_dict()
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    speculator = specula.load(STORIES, method="eagle3", draft=tmp_path / "head", dtype="float32",
                              total_tokens=6, depth=3, top_k=2)
    ids = speculator.encode(STORY_PROMPTS[16])
    result = speculator.generate(ids, max_new_tokens=24, stop_on_eos=False)
    expected = transformers_model(speculator.target.model).generate(ids[None], max_new_tokens=24, do_sample=False,
                                                                    min_new_tokens=24)[0, len(ids):]
    assert result.token_ids == expected.tolist()
    with pytest.raises(SpeculaError, match="2 decoder layers"):
        check_expressible(head, TargetInfo(stories_target.config.num_hidden_layers, 64, 512))


def test_a_head_started_from_the_target_output_predicts_through_the_target_lm_head(stories_target):
    model = stories_target.model
    vocab = torch.tensor([3, 9, 10, 200, 511])
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=vocab, feature_layers=list(STORY_LAYERS))
    head.start_from_target_output(model.get_output_embeddings(), model.model.norm)
    hidden = torch.randn(4, stories_target.config.hidden_size)
    with torch.no_grad():
        expected = model.get_output_embeddings()(model.model.norm(hidden))[:, vocab]
        torch.testing.assert_close(head.draft_logits(hidden), expected, atol=1e-5, rtol=1e-5)


def test_checkpoint_whose_tensors_disagree_with_config_is_refused(stories_target, tmp_path):
    Eagle3Head.for_target(stories_target.config, draft_vocab=torch.arange(128)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculaError, match="shape"):
        Eagle3Head.from_pretrained(tmp_path)


def test_training_loss_falls(eagle3_head_dir):
    history = json.loads((eagle3_head_dir / "training_history.json").read_text())
    losses = [h["loss"] for h in history if "loss" in h]
    # The soft cross-entropy cannot fall below the target's own entropy, so "falls" means a clear drop.
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4, losses
    assert any("acc2" in h for h in history)  # the simulated steps were trained too
    evaluations = [h["eval"] for h in history if "eval" in h]
    assert evaluations[-1]["0-alpha"] > 0.3, evaluations


@pytest.mark.parametrize("prompt", STORY_PROMPTS[16:19])
def test_eagle3_greedy_equals_transformers_generate(eagle3_head_dir, prompt):
    speculator = specula.load(STORIES, method="eagle3", draft=eagle3_head_dir, dtype="float32",
                              total_tokens=8, depth=6, top_k=3, draft_budget="off")  # every tree verified whole
    ids = speculator.encode(prompt)
    result = speculator.generate(ids, max_new_tokens=48, stop_on_eos=False)
    expected = transformers_model(speculator.target.model).generate(ids[None], max_new_tokens=48, do_sample=False,
                                                min_new_tokens=48)[0, len(ids):]
    assert result.token_ids == expected.tolist()
    assert result.stats.tau > 1.2  # drafts were really accepted


def test_eagle3_needs_a_head_and_rejects_a_head_of_another_kind(tmp_path):
    with pytest.raises(SpeculaError, match="needs --draft"):
        specula.load(STORIES, method="eagle3", dtype="float32")
    eagle_head = Path(__file__).parent / "data" / "eagle-stories260k"
    with pytest.raises(SpeculaError, match="not an EAGLE-3 head"):
        specula.load(STORIES, method="eagle3", draft=eagle_head, dtype="float32")


def test_fine_tuning_starts_from_the_given_head_and_keeps_its_vocabulary(stories_target, eagle3_samples,
                                                                           eagle3_head_dir, tmp_path):
    from specula.training.eagle3_trainer import Eagle3TrainOptions, train_eagle3
    from specula.training.loop import TrainConfig

    # Heads ship in bfloat16; fine-tuning starts from one.
    Eagle3Head.from_pretrained(eagle3_head_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "start")
    # A learning rate so small that the weights cannot move visibly: what comes out is what went in.
    config = TrainConfig(epochs=1, batch_size=4, lr=1e-12, warmup_steps=1, save_every=1000)
    options = Eagle3TrainOptions(steps=2, eval_samples=2, tau_prompts=1, init=tmp_path / "start")
    train_eagle3(stories_target, eagle3_samples[:8], eagle3_samples[16:18], tmp_path / "tuned", config, options,
                 log=lambda _: None)
    start, tuned = Eagle3Head.from_pretrained(tmp_path / "start"), Eagle3Head.from_pretrained(tmp_path / "tuned")
    assert tuned.draft_vocab_size == 256 and torch.equal(tuned.d2t, start.d2t)  # the head's vocabulary
    assert tuned.feature_layers == start.feature_layers == list(STORY_LAYERS)
    for (name, value), (_, expected) in zip(tuned.state_dict().items(), start.state_dict().items(), strict=True):
        torch.testing.assert_close(value.float(), expected.float(), atol=1e-6, rtol=0, msg=name)
    # Asking it for another vocabulary is refused rather than ignored.
    with pytest.raises(SpeculaError, match="--draft-vocab-size 64 differs from the --init head's 256"):
        train_eagle3(stories_target, eagle3_samples[:8], eagle3_samples[16:18], tmp_path / "other", config,
                     Eagle3TrainOptions(draft_vocab_size=64, init=tmp_path / "start"), log=lambda _: None)


def test_a_bfloat16_head_loaded_as_float32_keeps_exact_rotary_frequencies(eagle3_head_dir, tmp_path):
    from specula.heads.formats import load_head

    Eagle3Head.from_pretrained(eagle3_head_dir, dtype=torch.bfloat16).save_pretrained(tmp_path)
    exact = Eagle3Head.from_pretrained(eagle3_head_dir, dtype=torch.float32).rotary_emb.inv_freq
    loaded = load_head(tmp_path, dtype=torch.float32)
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.rotary_emb.inv_freq, exact)  # not bfloat16-rounded, as a cast afterwards leaves them


def test_fine_tuning_refuses_settings_that_contradict_the_head(capfd, eagle3_head_dir, tmp_path):
    from specula.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time."}) + "\n")
    base = ["train", "eagle3", "--target", str(STORIES), "--data", str(data), "--out", str(tmp_path / "out")]
    eagle_head = Path(__file__).parent / "data" / "eagle-stories260k"
    for extra, message in ((["--init", str(eagle3_head_dir), "--draft-vocab-size", "100"],
                            "--draft-vocab-size 100 differs from the --init head's 256"),
                           (["--init", str(eagle3_head_dir), "--feature-layers", "1,2,3"],
                            "--feature-layers 1,2,3 differs"),
                           (["--init", str(eagle_head)], "not an EAGLE-3 head"),
                           (["--init", str(tmp_path / "nowhere")], "does not exist")):
        assert main(base + extra) == 2
        err = capfd.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_compiled_head_step_computes_what_the_eager_step_computes(stories_target):
    """The head's steps under --compile (padded to the compiled sizes, the greedy draft's top tokens in the same
    graph) give the eager step's outputs, top tokens and cache: float32, where only Inductor's sums differ."""
    from specula.runtime.compiled_step import HeadStep

    torch.manual_seed(3)
    head = Eagle3Head.for_target(stories_target.config, feature_layers=list(STORY_LAYERS)).eval()
    steps = {kind: HeadStep(head, compile=kind == "compiled", device=torch.device("cpu"))
             for kind in ("eager", "compiled")}
    caches = {kind: head.new_cache(256) for kind in steps}
    features, embeds = torch.randn(24, 3 * 64), torch.randn(24, 64)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two children of the first pair
    outs = {}
    for kind, step in steps.items():
        cache = caches[kind]
        step(features[:20], embeds[:20], torch.arange(20), cache, None)  # the prompt: eager in both
        cache.commit()
        chain = step(features[20:22], embeds[20:22], torch.arange(20, 22), cache, None, top=3)  # a catch-up
        cache.commit()
        mask = torch.ones(1, 1, 3, 25, dtype=torch.bool)
        mask[0, 0, :, 22:] = tree
        grown = step(chain[0][-1:].expand(3, -1), embeds[21:24], torch.tensor([22, 23, 23]), cache, mask,
                     own_features=True)
        cache.commit()
        outs[kind] = (chain, grown, cache.keys[0][:, :, :cache.length])
    (chain, grown, keys), (chain_c, grown_c, keys_c) = outs["eager"], outs["compiled"]
    torch.testing.assert_close(chain_c[0], chain[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(chain_c[1], chain[1])  # the same top tokens, in target ids
    torch.testing.assert_close(chain_c[2], chain[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grown_c, grown, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys_c, keys, atol=1e-5, rtol=1e-5)


def test_a_compiled_tree_level_computes_what_the_eager_level_computes(stories_target):
    """EAGLE-2's tree level as one compiled graph (head step, top tokens, values, the next frontier, its mask and
    positions) gives the eager level's children, values and frontier: float32, where only Inductor's sums differ."""
    from specula.drafters.eagle_growth import LevelStep, first_frontier
    from specula.runtime.compiled_step import HeadStep

    torch.manual_seed(5)
    head = Eagle3Head.for_target(stories_target.config, feature_layers=list(STORY_LAYERS)).eval()
    embed = stories_target.model.get_input_embeddings()
    features = torch.randn(20, 3 * 64)
    tokens = torch.randint(0, stories_target.vocab_size, (20,))
    grown = {}
    for kind in ("eager", "compiled"):
        cache = head.new_cache(256)
        predicted = HeadStep(head, compile=False, device=torch.device("cpu"))(features, embed(tokens),
                                                                              torch.arange(20), cache, None)
        cache.commit()
        root_tokens, root_log_confidences = head.top_tokens(predicted[-1:], 3)
        frontier = first_frontier(root_tokens[0], root_log_confidences[0], predicted[-1:], depth=4)
        step = LevelStep(head, embed, compile=kind == "compiled", device=torch.device("cpu"))
        levels = []
        for level in range(3):
            child_tokens, values, q, frontier = step(cache, frontier, 20, level, None)
            assert q is None
            levels.append((child_tokens, values, frontier))
        grown[kind] = levels
        assert cache.length == 20  # levels write past the committed pairs and commit nothing
    for (tokens_e, values_e, frontier_e), (tokens_c, values_c, frontier_c) in zip(*grown.values(), strict=True):
        assert torch.equal(tokens_c, tokens_e)
        torch.testing.assert_close(values_c, values_e, atol=1e-5, rtol=1e-5)
        for name in ("rows", "tokens", "lineage"):
            assert torch.equal(getattr(frontier_c, name), getattr(frontier_e, name)), name
        torch.testing.assert_close(frontier_c.inputs, frontier_e.inputs, atol=1e-5, rtol=1e-5)
    assert grown["eager"][-1][2].lineage.sum(dim=1).tolist() == [3, 3, 3]  # a node at depth 4 sees 3 fed ancestors


@pytest.mark.parametrize("budget", [{}, {"total_tokens": 6, "depth": 3, "top_k": 2}], ids=["one-node", "grown"])
def test_eagle3_on_a_compiled_target_drafts_compiled_and_decodes_what_transformers_decodes(eagle3_head_dir, budget):
    speculator = specula.load(STORIES, method="eagle3", draft=eagle3_head_dir, dtype="float32", compile=True,
                              profile=False, head_only=True, draft_budget="off", **budget)
    from torch._dynamo.utils import counters

    from specula.decoding import warm_up

    assert speculator.drafter.head_step.graph is not None and speculator.drafter.level_step.graph is not None
    # Blocks of the root and the tree's nodes at most (1 + 1, 1 + 6), catch-ups of at most depth + 1 pairs.
    warm_up(speculator.target, speculator.drafter, max_block=1 + budget.get("total_tokens", 1))
    compiled_before = counters["stats"]["unique_graphs"]
    accepted = 0
    for prompt in STORY_PROMPTS[16:18]:
        ids = speculator.encode(prompt)
        result = speculator.generate(ids, max_new_tokens=32, stop_on_eos=False)
        expected = transformers_model(speculator.target.model).generate(ids[None], max_new_tokens=32, do_sample=False,
                                                    min_new_tokens=32)[0, len(ids):]
        assert result.token_ids == expected.tolist()
        accepted += sum(result.stats.accepted_lengths)
    assert accepted > 0  # the compiled drafts were accepted
    # The warm-up compiled every step a decode met: the catch-up steps, and a grown tree's one level graph.
    assert counters["stats"]["unique_graphs"] == compiled_before


def test_an_eagle3_head_compiled_after_an_eagle_head_runs_its_own_graph():
    """Heads of different structure compiled in one process (a bench, a server) never share a graph: on an H200
    the EAGLE-3 head's first compiled step met the EAGLE head's graph and failed (KeyError: 'layers')."""
    from specula.runtime.compiled_step import graph_function

    data = Path(__file__).parent / "data"
    speculators = {method: specula.load(STORIES, method=method, draft=data / head, dtype="float32", compile=True,
                                        profile=False, head_only=True)
                   for method, head in (("eagle", "eagle-stories260k"), ("eagle3", "eagle3-stories260k"))}
    vanilla = specula.load(STORIES, method="vanilla", dtype="float32", profile=False)
    ids = vanilla.encode(STORY_PROMPTS[16])
    expected = vanilla.generate(ids, max_new_tokens=24, stop_on_eos=False).token_ids
    for speculator in speculators.values():  # eagle compiles first, then eagle3 in the same process
        result = speculator.generate(ids, max_new_tokens=24, stop_on_eos=False)
        assert result.token_ids == expected and sum(result.stats.accepted_lengths) > 0
    eagle_head, eagle3_head = (s.drafter.head for s in speculators.values())
    assert graph_function(eagle_head) is not graph_function(eagle3_head)
    again = specula.load(STORIES, method="eagle3", draft=data / "eagle3-stories260k", dtype="float32", profile=False,
                         head_only=True)
    assert graph_function(again.drafter.head) is graph_function(eagle3_head)  # one structure, one graph
