"""Training data: record formats, loss masks, self-distillation, the feature cache and its resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import STORIES, STORY_PROMPTS

import specula
import specula.training.features as features_module
from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, Target
from specula.training import regeneration
from specula.training.features import CachedFeatures, cache_features
from specula.training.recipe import Subset
from specula.training.records import TrainingRecord, build_samples, read_records
from specula.training.regeneration import prepare_samples, regenerate

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Bot: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}User: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}Bot:{% endif %}"
)
REQUEST = FeatureRequest(final_hidden=True, layer_inputs=(0, 3))


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.load(STORIES, dtype="float32")


@pytest.fixture(scope="module")
def chat_target() -> Target:
    """stories260k with a chat template on its (own copy of the) tokenizer."""
    chat = Target.load(STORIES, dtype="float32")
    chat.tokenizer.chat_template = CHAT_TEMPLATE
    return chat


def write_jsonl(path, rows) -> None:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in ``mask``."""
    found, start = [], None
    for i, value in enumerate([*mask.tolist(), False]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            found.append((start, i))
            start = None
    return found


def test_reader_accepts_each_format(tmp_path):
    file = tmp_path / "data.jsonl"
    write_jsonl(file, [
        {"conversations": [{"from": "gpt", "value": "dropped opener"}, {"from": "system", "value": "Be brief."},
                           {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        "",
        {"prompt": "def f(x):\n"},
        {"prompt": "Once upon a time", "response": " there was a cat."},
        {"text": "Tom and his dog went to the park."},
    ])
    records = read_records(file)
    assert [r.messages for r in records[:4]] == [
        (("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello.")),
        (("user", "Q"), ("assistant", "A")),
        (("user", "def f(x):\n"),),
        (("user", "Once upon a time"), ("assistant", " there was a cat.")),
    ]
    assert records[4].text == "Tom and his dog went to the park." and records[4].messages == ()
    assert records[3].source.endswith("line 5")


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"question": "x"}', "unknown record format"),
    ('{"prompt": ""}', "'prompt' is empty"),
    ('{"prompt": "x", "response": 3}', "'response' must be a string"),
    ('{"text": "   "}', "'text' is empty"),
    ('{"conversations": []}', "non-empty list"),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "speaker 'robot'"),
    ('{"conversations": [{"from": "human", "value": ""}]}', "turn 0 value is empty"),
    ('{"conversations": [{"from": "gpt", "value": "only the model"}]}', "no human/user turn"),
])
def test_reader_rejects_malformed_lines_naming_the_line(tmp_path, bad, message):
    file = tmp_path / "data.jsonl"
    write_jsonl(file, [{"prompt": "fine"}, bad])
    with pytest.raises(SpeculaError, match=f"data.jsonl, line 2: .*{message}"):
        read_records(file)


def test_reader_rejects_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SpeculaError, match="holds no records"):
        read_records(tmp_path / "empty.jsonl")
    with pytest.raises(SpeculaError, match="not found"):
        read_records(tmp_path / "missing.jsonl")


def test_loss_mask_of_a_prompt_record_is_exactly_the_response(target):
    tokenizer = target.tokenizer
    record = TrainingRecord((("user", "Once upon a time"), ("assistant", " there was a cat.")))
    [sample] = build_samples([record], tokenizer)
    prompt = tokenizer("Once upon a time").input_ids
    response = tokenizer(" there was a cat.", add_special_tokens=False).input_ids
    assert sample.input_ids.tolist() == prompt + response
    assert sample.loss_mask.tolist() == [False] * len(prompt) + [True] * len(response)
    # A text record without regeneration is trained on whole (all but the BOS the tokenizer adds).
    [text] = build_samples([TrainingRecord(text="Tom and his dog went to the park.")], tokenizer)
    assert text.input_ids[0] == tokenizer.bos_token_id and text.loss_mask.tolist() == [False] + [True] * (
        len(text.input_ids) - 1)
    assert torch.equal(prepare_samples(target, [record], regenerate=False, log=None)[0].loss_mask, sample.loss_mask)
    with pytest.raises(SpeculaError, match="no response to train on"):
        build_samples([TrainingRecord((("user", "no reply"),), source="x.jsonl, line 7")], tokenizer)


def test_loss_mask_of_a_multi_turn_conversation_with_a_chat_template(chat_target):
    tokenizer = chat_target.tokenizer
    replies = ["Hello there.", "The cat sat on the mat."]
    record = TrainingRecord((("system", "Be kind."), ("user", "Hi"), ("assistant", replies[0]),
                             ("user", "Tell a story"), ("assistant", replies[1])))
    [sample] = build_samples([record], tokenizer)
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in record.messages], tokenize=False)
    assert sample.input_ids.tolist() == tokenizer(text, add_special_tokens=False).input_ids
    # Exactly the two replies, each with the end-of-turn marker the template puts after it.
    spans = runs(sample.loss_mask)
    assert len(spans) == 2
    for (start, end), reply in zip(spans, replies, strict=True):
        expected = tokenizer(" " + reply, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        assert sample.input_ids[start:end].tolist() == expected


def test_regeneration_is_the_targets_own_greedy_continuation(target, monkeypatch):
    prompts = [STORY_PROMPTS[0], STORY_PROMPTS[1], STORY_PROMPTS[15]]  # different lengths: left padding
    records = [TrainingRecord((("user", p),)) for p in prompts]
    speculator = specula.load(STORIES, method="vanilla", dtype="float32")

    def check(max_new_tokens: int, reference) -> list[list[int]]:
        samples = regenerate(target, records, max_new_tokens=max_new_tokens, batch_size=3, progress=False)
        replies = []
        for prompt, sample in zip(prompts, samples, strict=True):
            prompt_ids = target.tokenizer(prompt).input_ids
            expected = reference(prompt_ids, max_new_tokens)
            assert sample.input_ids.tolist() == prompt_ids + expected
            assert sample.loss_mask.tolist() == [False] * len(prompt_ids) + [True] * len(expected)
            replies.append(expected)
        return replies

    # Batched with left padding == specula's own runtime, one prompt at a time.
    replies = check(24, lambda ids, n: speculator.generate(ids, max_new_tokens=n).token_ids)
    # Greedy stories260k never ends a story within its context: make a token it writes early the EOS,
    # so that one row stops (EOS kept, nothing after it) while the others go on past it; the
    # reference is `transformers` generate on each prompt alone (no padding).
    monkeypatch.setattr(target, "eos_token_ids", {replies[1][5]})
    stopped = check(24, lambda ids, n: regeneration.generate_batch(target, [ids], n)[0])
    assert len(stopped[1]) == 6 and stopped[1][-1] == replies[1][5]
    assert max(len(r) for r in stopped) > 6


def test_regeneration_of_text_conversations_and_sampling(target, chat_target):
    text = "Tom and his dog went to the park. They played with a ball all day long."
    [sample] = regenerate(target, [TrainingRecord(text=text)], max_new_tokens=8, progress=False)
    ids = target.tokenizer(text).input_ids
    assert sample.input_ids.tolist()[: len(ids) // 2] == ids[: len(ids) // 2]
    assert int(sample.loss_mask.sum()) == len(sample.input_ids) - len(ids) // 2
    # Sampling is deterministic for a seed.
    records = [TrainingRecord((("user", p),)) for p in STORY_PROMPTS[:4]]
    first = regenerate(target, records, max_new_tokens=12, temperature=1.0, batch_size=2, seed=5, progress=False)
    again = regenerate(target, records, max_new_tokens=12, temperature=1.0, batch_size=2, seed=5, progress=False)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again, strict=True))
    # A conversation is regenerated turn by turn; every assistant turn is in the loss.
    conversation = TrainingRecord((("user", "Hi"), ("assistant", "old reply"), ("user", "Tell a story")))
    [chat] = regenerate(chat_target, [conversation], max_new_tokens=10, progress=False)
    spans = runs(chat.loss_mask)
    assert len(spans) == 2 and spans[-1][1] == len(chat.input_ids)
    assert "old reply" not in chat_target.tokenizer.decode(chat.input_ids)


def test_feature_cache_round_trip_and_resume(target, tmp_path, monkeypatch):
    records = [TrainingRecord((("user", p), ("assistant", " and they were happy."))) for p in STORY_PROMPTS[:5]]
    samples = build_samples(records, target.tokenizer)
    cache = cache_features(target, samples, tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    assert len(cache) == 5 and len(list(tmp_path.glob("features-*.safetensors"))) == 3
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_samples"] == 5 and manifest["dtype"] == "float32"
    for i, sample in enumerate(samples):
        # Batched (right-padded) passes: the same features as one prefill per sample, up to matmul rounding.
        out = target.prefill(sample.input_ids, REQUEST)
        item = cache[i]
        assert torch.equal(item["input_ids"], sample.input_ids) and torch.equal(item["loss_mask"], sample.loss_mask)
        torch.testing.assert_close(item["hidden"], out.hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(item["layer_inputs"], torch.stack([out.layer_inputs[0], out.layer_inputs[3]], 1),
                                   rtol=1e-4, atol=1e-4)
        assert torch.equal(item["target_top"], out.logits.argmax(-1))
    assert torch.equal(cache[-1]["input_ids"], samples[-1].input_ids)

    # Resume: only the missing shard is computed again; the others are not rewritten.
    calls = []
    batched = features_module.batched_features

    def counting(target_, sequences, request):
        calls.extend(len(ids) for ids in sequences)
        return batched(target_, sequences, request)

    monkeypatch.setattr(features_module, "batched_features", counting)
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("features-*.safetensors")}
    (tmp_path / "features-00001.safetensors").unlink()
    cache = cache_features(target, samples, tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    assert sorted(calls) == sorted([len(samples[2].input_ids), len(samples[3].input_ids)])
    for name in ("features-00000.safetensors", "features-00002.safetensors"):
        assert (tmp_path / name).stat().st_mtime_ns == kept[name]
    torch.testing.assert_close(cache[3]["hidden"], target.prefill(samples[3].input_ids, REQUEST).hidden,
                               rtol=1e-4, atol=1e-4)

    # An interrupted run leaves an incomplete cache (refused for reading) that the next run finishes.
    fresh = tmp_path / "interrupted"
    calls.clear()

    def failing(target_, sequences, request):
        if len(calls) >= 2:
            raise KeyboardInterrupt
        return counting(target_, sequences, request)

    monkeypatch.setattr(features_module, "batched_features", failing)
    with pytest.raises(KeyboardInterrupt):
        cache_features(target, samples, fresh, REQUEST, shard_size=2, progress=False, log=None)
    assert sorted(p.name for p in fresh.glob("features-*")) == ["features-00000.safetensors"]
    with pytest.raises(SpeculaError, match="incomplete"):
        CachedFeatures(fresh)
    monkeypatch.setattr(features_module, "batched_features", counting)
    calls.clear()
    cache = cache_features(target, samples, fresh, REQUEST, shard_size=2, progress=False, log=None)
    assert len(calls) == 3
    torch.testing.assert_close(cache[4]["hidden"], target.prefill(samples[4].input_ids, REQUEST).hidden,
                               rtol=1e-4, atol=1e-4)


def test_added_samples_compute_only_the_shards_that_changed(target, tmp_path, monkeypatch):
    records = [TrainingRecord((("user", p), ("assistant", " and they were happy."))) for p in STORY_PROMPTS[:6]]
    samples = build_samples(records, target.tokenizer)
    cache_features(target, samples[:5], tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("features-*.safetensors")}
    calls = []
    batched = features_module.batched_features
    monkeypatch.setattr(features_module, "batched_features",
                        lambda t, sequences, r: calls.extend(map(len, sequences)) or batched(t, sequences, r))
    grown = cache_features(target, samples, tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    assert sorted(calls) == sorted([len(samples[4].input_ids), len(samples[5].input_ids)])  # the last shard only
    for name in ("features-00000.safetensors", "features-00001.safetensors"):
        assert (tmp_path / name).stat().st_mtime_ns == kept[name]
    assert len(grown) == 6 and torch.equal(grown[5]["input_ids"], samples[5].input_ids)
    torch.testing.assert_close(grown[5]["hidden"], target.prefill(samples[5].input_ids, REQUEST).hidden,
                               rtol=1e-4, atol=1e-4)
    calls.clear()
    changed = [samples[1], samples[0], *samples[2:]]  # the first shard's samples swapped: it no longer matches
    cache = cache_features(target, changed, tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    assert sorted(calls) == sorted([len(samples[0].input_ids), len(samples[1].input_ids)])
    assert torch.equal(cache[0]["input_ids"], samples[1].input_ids)


def test_a_cache_built_for_other_settings_is_refused(target, tmp_path):
    records = [TrainingRecord((("user", p),)) for p in STORY_PROMPTS[:3]]
    samples = prepare_samples(target, records, cache_dir=tmp_path, max_new_tokens=6, batch_size=2, progress=False,
                              log=None)
    again = prepare_samples(target, records, cache_dir=tmp_path, max_new_tokens=6, batch_size=2, progress=False,
                            log=None)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, again, strict=True))
    with pytest.raises(SpeculaError, match=r"other settings \(max_new_tokens: 6 -> 7\)"):
        prepare_samples(target, records, cache_dir=tmp_path, max_new_tokens=7, batch_size=2, progress=False)
    answered = [TrainingRecord((("user", p), ("assistant", "Once upon a time"))) for p in STORY_PROMPTS[:2]]
    prepare_samples(target, answered, cache_dir=tmp_path / "own", regenerate=False, log=None)
    with pytest.raises(SpeculaError, match="other data"):  # samples that were not regenerated are never lent
        prepare_samples(target, answered[:1], cache_dir=tmp_path / "own", regenerate=False, log=None)

    cache_features(target, samples, tmp_path, REQUEST, shard_size=2, progress=False, log=None)
    with pytest.raises(SpeculaError, match="other request"):
        cache_features(target, samples, tmp_path, FeatureRequest(final_hidden=True), shard_size=2, progress=False)
    with pytest.raises(SpeculaError, match="other shard_size"):
        cache_features(target, samples, tmp_path, REQUEST, shard_size=1, progress=False)
    other = Target.load(STORIES, dtype="bfloat16")
    with pytest.raises(SpeculaError, match="other target"):
        cache_features(other, samples, tmp_path, REQUEST, shard_size=2, progress=False)
    with pytest.raises(SpeculaError, match="another target"):
        CachedFeatures(tmp_path, target=other)


def test_added_prompts_regenerate_only_the_new_records(target, tmp_path, monkeypatch):
    first = [TrainingRecord((("user", p),)) for p in STORY_PROMPTS[:3]]
    settings = dict(cache_dir=tmp_path, max_new_tokens=6, batch_size=2, progress=False, log=None)
    before = prepare_samples(target, first, **settings)
    generated = []
    original = regeneration.generate_batch
    monkeypatch.setattr(regeneration, "generate_batch", lambda *a, **k: generated.extend(a[1]) or original(*a, **k))
    new = TrainingRecord((("user", STORY_PROMPTS[3]),))
    grown = [first[2], new, first[0], first[1]]  # reordered, and one record added
    logged = []
    samples = prepare_samples(target, grown, **{**settings, "batch_size": 3, "log": logged.append})
    assert len(generated) == 1  # only the new record's prompt went to the target
    assert logged[0].startswith("reusing 3 of 4 samples")
    for sample, old in zip([samples[2], samples[3], samples[0]], before, strict=True):
        assert torch.equal(sample.input_ids, old.input_ids) and torch.equal(sample.loss_mask, old.loss_mask)
    fresh = regenerate(target, [new], max_new_tokens=6, progress=False)[0]
    assert torch.equal(samples[1].input_ids, fresh.input_ids) and torch.equal(samples[1].loss_mask, fresh.loss_mask)
    generated.clear()
    again = prepare_samples(target, grown, **{**settings, "batch_size": 3})  # the cache now holds the grown data
    assert not generated and all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, samples, strict=True))
    with pytest.raises(SpeculaError, match=r"other settings \(max_new_tokens: 6 -> 7"):
        prepare_samples(target, grown, **{**settings, "batch_size": 3, "max_new_tokens": 7})


def test_an_interrupted_regeneration_of_added_prompts_resumes(target, tmp_path, monkeypatch):
    records = [TrainingRecord((("user", p),)) for p in STORY_PROMPTS[:6]]
    settings = dict(cache_dir=tmp_path, max_new_tokens=6, batch_size=2, progress=False, log=None)
    prepare_samples(target, records[:2], **settings)
    generated = []
    original = regeneration.generate_batch

    def interrupted(*args, **kwargs):
        if len(generated) == 1:
            raise KeyboardInterrupt
        generated.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(regeneration, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_samples(target, records, **settings)
    monkeypatch.setattr(regeneration, "generate_batch", lambda *a, **k: generated.append(a[1]) or original(*a, **k))
    generated.clear()
    samples = prepare_samples(target, records, **settings)
    assert len(generated) == 1  # of the 4 added records' 2 batches, one came from the journal
    seeded = prepare_samples(target, records[:2], max_new_tokens=6, batch_size=2, progress=False, log=None)
    added = regenerate(target, records[2:], max_new_tokens=6, batch_size=2, progress=False)  # the same batches
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, seeded + added, strict=True))


def test_interrupted_regeneration_resumes_from_its_journal(target, tmp_path, monkeypatch):
    records = [TrainingRecord((("user", p),)) for p in STORY_PROMPTS[:6]]
    settings = dict(max_new_tokens=8, temperature=1.0, batch_size=2, seed=3, progress=False, log=None)
    reference = prepare_samples(target, records, **settings)
    generated = []
    original = regeneration.generate_batch

    def interrupted(*args, **kwargs):
        if len(generated) == 2:
            raise KeyboardInterrupt
        generated.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(regeneration, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_samples(target, records, cache_dir=tmp_path, **settings)
    assert not (tmp_path / "samples.pt").exists()
    monkeypatch.setattr(regeneration, "generate_batch", lambda *a, **k: generated.append(a[1]) or original(*a, **k))
    generated.clear()
    samples = prepare_samples(target, records, cache_dir=tmp_path, **settings)
    assert len(generated) == 1  # two of the three batches came from the journal
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, reference, strict=True))
    assert not (tmp_path / "samples.journal.jsonl").exists()


def test_train_samples_cut_the_train_set_and_keep_the_held_out_set(target, tmp_path):
    from specula.training.recipe import DataOptions, feature_sets

    write_jsonl(tmp_path / "data.jsonl", [{"prompt": p} for p in STORY_PROMPTS[:12]])
    options = dict(data=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache", max_new_tokens=6, eval_samples=3)
    request = FeatureRequest(final_hidden=True)
    full_train, full_eval = feature_sets(target, DataOptions(**options), request, log=None)
    small_train, small_eval = feature_sets(target, DataOptions(**options, train_samples=4), request, log=None)
    assert len(full_train) == 9 and len(small_train) == 4
    assert small_train.indices == full_train.indices[:4] and small_eval.indices == full_eval.indices
    with pytest.raises(SpeculaError, match="exceeds the 9 training samples"):
        feature_sets(target, DataOptions(**options, train_samples=10), request, log=None)


def test_greedy_and_sampled_responses_train_together_and_keep_the_greedy_held_out_set(target, tmp_path):
    from specula.training.recipe import DataOptions, feature_sets

    write_jsonl(tmp_path / "data.jsonl", [{"prompt": p} for p in STORY_PROMPTS[:12]])
    options = dict(data=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache", max_new_tokens=6, eval_samples=3)
    request = FeatureRequest(final_hidden=True)
    greedy_train, greedy_eval = feature_sets(target, DataOptions(**options), request, log=None)
    both_train, both_eval = feature_sets(target, DataOptions(**options, temperatures=(0.0, 1.0)), request, log=None)
    # The greedy samples keep their cache, their places and the held-out set; each training record adds its
    # sampled response, and no held-out record's sampled response is trained on.
    cache = tmp_path / "cache"
    assert (cache / "samples.pt").is_file() and (cache / "samples-t1" / "samples.pt").is_file()
    assert both_eval.indices == greedy_eval.indices and both_train.indices[:9] == greedy_train.indices
    assert len(both_train) == 18 and all(i >= 12 for i in both_train.indices[9:])
    held_prompts = {tuple(greedy_eval[i]["input_ids"][~greedy_eval[i]["loss_mask"]].tolist()) for i in range(3)}
    sampled = [both_train[i] for i in range(9, 18)]
    trained_prompts = {tuple(item["input_ids"][~item["loss_mask"]].tolist()) for item in sampled}
    assert len(trained_prompts) == 9 and not held_prompts & trained_prompts
    greedy = [both_train[i] for i in range(9)]
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(greedy, sampled, strict=True))
    with pytest.raises(SpeculaError, match="each regeneration temperature once"):
        DataOptions(**options, temperatures=(1.0, 1.0))


def test_prompt_crop_keeps_the_response_and_the_last_prompt_tokens():
    from specula.training.recipe import PromptCrop

    mask = torch.tensor([False] * 6 + [True] * 3)
    item = {"input_ids": torch.arange(9), "loss_mask": mask, "hidden": torch.arange(18.0).view(9, 2)}
    cropped = PromptCrop([item], context=2)[0]
    assert cropped["input_ids"].tolist() == [4, 5, 6, 7, 8]
    assert cropped["loss_mask"].tolist() == [False, False, True, True, True]
    assert torch.equal(cropped["hidden"], item["hidden"][4:])
    assert PromptCrop([item], context=10)[0]["input_ids"].tolist() == list(range(9))


def padded_share(order: list[int], lengths: list[int], batch: int) -> float:
    """Real tokens over padded tokens of the whole batches of ``order``."""
    real = padded = 0
    for start in range(0, len(order) - batch + 1, batch):
        rows = [lengths[i] for i in order[start:start + batch]]
        real, padded = real + sum(rows), padded + max(rows) * batch
    return real / padded


def test_length_grouped_epochs_use_every_sample_once_with_less_padding():
    from specula.training.loop import epoch_order

    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(20, 2000, (1000,), generator=generator).tolist()
    grouped = [epoch_order(1000, 7, epoch, lengths, 8) for epoch in range(2)]
    for order in grouped:
        assert sorted(order) == list(range(1000))  # a permutation: each sample once per epoch
    assert grouped[0] == epoch_order(1000, 7, 0, lengths, 8)  # seeded: a resumed run sees the same batches
    batches = [{frozenset(order[i:i + 8]) for i in range(0, 1000, 8)} for order in grouped]
    assert len(batches[0] & batches[1]) < 10  # other batches every epoch, not one fixed set
    plain = epoch_order(1000, 7, 0)
    assert padded_share(plain, lengths, 8) < 0.6 < 0.85 < padded_share(grouped[0], lengths, 8)


def test_cached_features_tell_their_lengths_without_reading_features(target, tmp_path):
    records = [TrainingRecord((("user", p), ("assistant", " and they were happy."))) for p in STORY_PROMPTS[:5]]
    samples = build_samples(records, target.tokenizer)
    cache = cache_features(target, samples, tmp_path, REQUEST, shard_size=2, progress=False, log=None)  # 3 shards
    assert cache.lengths() == [len(sample.input_ids) for sample in samples]
    assert Subset(cache, [4, 0]).lengths() == [len(samples[4].input_ids), len(samples[0].input_ids)]
