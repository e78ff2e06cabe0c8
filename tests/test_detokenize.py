"""Streaming text: the pieces add up to the whole decode, and each piece comes as soon as it is complete."""

from __future__ import annotations

import random

import pytest
from conftest import STORIES
from transformers import AutoTokenizer

from specula.detokenize import IncrementalDecoder


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES, local_files_only=True)


@pytest.mark.parametrize("seed", range(5))
def test_pieces_add_up_to_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    text = "Once upon a time, Lily saw a big dog. \"Hello!\" she said. It was fun — très bien, 日本. The end.\n"
    ids = tokenizer(text * 3).input_ids[1:]
    decoder, pieces, start = IncrementalDecoder(tokenizer), [], 0
    while start < len(ids):
        size = rng.randint(1, 4)
        pieces.append(decoder.push(ids[start:start + size]))
        start += size
    pieces.append(decoder.finish())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(bool(p) for p in pieces[:-1]) >= len(pieces) // 2  # text streams; it is not all held to the end


def test_a_split_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer("日本", add_special_tokens=False).input_ids
    byte_tokens = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_tokens) >= 2  # the stories vocabulary spells CJK characters byte by byte
    decoder = IncrementalDecoder(tokenizer)
    first = decoder.push(ids[:2])
    assert "\ufffd" not in first
    assert first + decoder.push(ids[2:]) + decoder.finish() == tokenizer.decode(ids)
