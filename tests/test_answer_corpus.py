"""The answer corpus (a fixed index of the target's own answers): the same drafts as a suffix trie of the same texts,
its file, and the suffix drafter drafting from it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specula.drafters.answer_corpus import AnswerCorpus
from specula.drafters.suffix import SuffixDrafter
from specula.drafters.suffix_index import SuffixCorpus
from specula.errors import SpeculaError
from specula.sampling import SamplingParams


def random_texts(seed: int, vocab: int = 5, count: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tree", [True, False])
def test_the_corpus_drafts_what_a_suffix_trie_of_the_same_texts_drafts(seed, tree):
    """Counts, probabilities, the longest match with a continuation and the recency tie-break all agree."""
    texts, depth = random_texts(seed), 10
    trie = SuffixCorpus(max_nodes=1 << 30, depth=depth)
    for text in texts:
        trie.add("texts", text)
    corpus = AnswerCorpus.from_texts(texts, depth)
    rng = random.Random(100 + seed)
    for _ in range(60):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]  # token 5 never occurs
        draft = {"budget": rng.choice([1, 2, 4, 8]), "max_depth": rng.choice([1, 3, 8]), "min_prob": 0.1,
                 "spec_factor": rng.choice([1.0, 4.0]), "tree": tree}
        longest = rng.choice([1, 4, 8])
        assert corpus.propose(context, longest, **draft) == trie.propose("texts", context, longest, **draft)


def test_a_phrase_never_runs_from_one_text_into_the_next():
    corpus = AnswerCorpus.from_texts([[1, 2], [3, 4]], depth=4)
    assert corpus.occurrences([2, 3]) is None
    assert corpus.propose([2], 4, budget=4, max_depth=4, min_prob=0.0, spec_factor=4.0, tree=True).tokens == []
    assert corpus.propose([1], 4, budget=4, max_depth=4, min_prob=0.0, spec_factor=4.0, tree=True).tokens == [2]


@pytest.mark.parametrize("large_vocab", [False, True])
def test_a_saved_corpus_loads_with_the_same_drafts(tmp_path, large_vocab):
    texts = random_texts(7, vocab=100_000 if large_vocab else 5)
    corpus = AnswerCorpus.from_texts(texts, depth=6, tokenizer="abc")
    corpus.save(tmp_path / "answers.safetensors")
    loaded = AnswerCorpus.load(tmp_path / "answers.safetensors", depth=6)
    assert (loaded.tokenizer, loaded.texts, loaded.separator) == ("abc", len(texts), corpus.separator)
    assert (loaded.columns == corpus.columns).all() and (loaded.order == corpus.order).all()


def test_a_later_load_maps_the_kept_sorted_windows_and_a_damaged_copy_is_sorted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "cache"))
    texts = random_texts(11)
    AnswerCorpus.from_texts(texts, depth=6).save(tmp_path / "answers.safetensors")
    first = AnswerCorpus.load(tmp_path / "answers.safetensors", depth=6)  # sorts, and keeps the result
    kept = sorted((tmp_path / "cache" / "answer-index").iterdir())
    assert [p.name.rsplit("-", 1)[1] for p in kept] == ["columns.npy", "order.npy"]
    mapped = AnswerCorpus.load(tmp_path / "answers.safetensors", depth=6)
    assert isinstance(mapped.order.base, np.memmap) and isinstance(mapped.columns.base, np.memmap)  # the files
    deeper = AnswerCorpus.load(tmp_path / "answers.safetensors", depth=4)  # another depth: its own index
    assert deeper.columns.shape[0] == 4 and len(list(kept[0].parent.iterdir())) == 4
    draft = {"budget": 4, "max_depth": 4, "min_prob": 0.0, "spec_factor": 4.0, "tree": True}
    contexts = ([0], [1, 2], [3, 4, 0], [2, 2])
    assert (mapped.order == first.order).all() and (mapped.columns == first.columns).all()
    assert [mapped.propose(c, 4, **draft) for c in contexts] == [first.propose(c, 4, **draft) for c in contexts]
    head = kept[1].read_bytes()[:100]
    kept[1].unlink()  # replaced by a truncated order file (a new file, as the cache never writes one in place)
    kept[1].write_bytes(head)
    rebuilt = AnswerCorpus.load(tmp_path / "answers.safetensors", depth=6)
    assert (rebuilt.order == first.order).all() and (rebuilt.columns == first.columns).all()
    assert kept[1].stat().st_size > 100  # kept whole again


def test_a_file_that_is_not_a_corpus_is_refused_in_one_line(tmp_path):
    for content in (b"", b"not safetensors at all"):
        (tmp_path / "bad.safetensors").write_bytes(content)
        with pytest.raises(SpeculaError, match="answer corpus"):
            AnswerCorpus.load(tmp_path / "bad.safetensors", depth=4)
    with pytest.raises(SpeculaError, match="answer corpus"):
        AnswerCorpus.load(tmp_path / "missing.safetensors", depth=4)


def test_the_suffix_drafter_drafts_from_the_answers_where_the_context_has_nothing_to_copy():
    answers = AnswerCorpus.from_texts([[7, 8, 9, 10], [7, 8, 9, 11], [7, 8, 9, 10]], depth=8)
    params = SamplingParams(0.0, 0, 1.0)
    plain, drafting = SuffixDrafter(), SuffixDrafter(answers=answers, answer_nodes=2)
    context = torch.tensor([1, 2, 3, 7, 8])
    assert plain.propose(context, 8, params, None).tokens.tolist() == [8]  # the root alone
    draft = drafting.propose(context, 8, params, None)
    assert draft.tokens.tolist() == [8, 9, 10] and draft.kind == "answers match 2"  # at most answer_nodes drafts
    assert drafting.fork().answers is answers


def test_the_default_target_drafts_from_its_bundled_answers_unless_told_none(smollm2, tmp_path):
    """suffix and the head methods' grafted suffix drafter read the bundled corpus; 'none' and --head-only read none."""
    from specula.methods import build_speculator

    target = smollm2.speculator.target
    suffix = build_speculator(target, "suffix", profile=False)
    assert suffix.drafter.answers is not None and suffix.drafter.answers.texts == 6402
    assert build_speculator(target, "suffix", profile=False, answers="none").drafter.answers is None
    merged = build_speculator(target, "eagle3", profile=False)
    assert merged.drafter.suffix_drafter.answers is suffix.drafter.answers  # one copy per process
    assert not hasattr(build_speculator(target, "eagle3", profile=False, head_only=True).drafter, "suffix_drafter")
    with pytest.raises(SpeculaError, match="no such file"):  # before any model loads
        build_speculator(target, "suffix", profile=False, answers="/nonexistent/answers.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpeculaError, match="cannot read the answer corpus"):
        build_speculator(target, "suffix", profile=False, answers=tmp_path / "bad.safetensors")
