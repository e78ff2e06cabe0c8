"""The target's tokenizer as GGUF metadata (the ``tokenizer.*`` keys), for draft models llama.cpp runs beside it.

llama.cpp loads a draft GGUF with a vocabulary of its own, and an EAGLE-3 draft maps its
draft ids into that vocabulary, so the draft must carry the target's. `add_target_vocab`
writes it from either kind of target:

- a GGUF target (what llama.cpp itself will run): every ``tokenizer.*`` key copied
  verbatim, value types and order kept — byte for byte the vocabulary llama.cpp loads
  for the target, whichever converter made it;
- a Hugging Face directory: the rules of llama.cpp's converter, which reads the
  tokenizer of the directory given as ``--target-model-dir`` (``conversion/llama.py``,
  ``LlamaModel.set_vocab``; ``conversion/base.py``, ``TextModel._set_vocab_sentencepiece``,
  ``_create_vocab_sentencepiece``, ``_set_vocab_llama_hf``, ``does_token_look_special``):
  ``add_prefix_space`` of tokenizer_config.json, then a SentencePiece ``tokenizer.model``
  (read here without the sentencepiece package: it is a small protobuf), else a
  Llama-style tokenizer.json (`gguf.LlamaHfVocab`), then `gguf.SpecialVocab`, and the
  converter's two vocabulary-size special cases (32016: CodeLlama's infill tokens;
  49152: no BOS). A GPT-2-style BPE tokenizer is refused: the converter names its
  pre-tokenizer from a table of tokenizer hashes only it carries, so such a target must be
  given as the GGUF llama.cpp runs.
"""

from __future__ import annotations

import json
import logging
import struct
from contextlib import contextmanager
from pathlib import Path

from specula.errors import SpeculaError

TOKENIZER_PREFIX = "tokenizer."
# does_token_look_special(): added tokens that ought to be control tokens though not marked special
_SPECIAL_LOOKING = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
_SPACE_MARK = "\u2581"  # SentencePiece's visible space, pre-normalised to " " in user-defined tokens


def copy_gguf_vocab(writer, reader) -> int:
    """Copy every ``tokenizer.*`` key of an open `gguf.GGUFReader` into ``writer``; returns how many."""
    from gguf import GGUFValueType

    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        kind = GGUFValueType(field.types[0])
        if kind == GGUFValueType.ARRAY:
            sub = GGUFValueType(field.types[-1])
            if sub == GGUFValueType.STRING:  # raw bytes: a token need not be valid UTF-8
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = list(field.contents())
            writer.add_key_value(key, value, kind, sub_type=sub)
        elif kind == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), kind)
        else:
            writer.add_key_value(key, field.contents(), kind)
        copied += 1
    return copied


def add_hf_vocab(writer, target_dir: Path, vocab_size: int) -> None:
    """The tokenizer of the Hugging Face model in ``target_dir``, as llama.cpp's converter writes it.

    ``vocab_size`` is the draft config's vocabulary size (the converter pads or cuts to it).
    """
    import gguf

    config = _json(target_dir / "tokenizer_config.json")
    if config.get("add_prefix_space") is not None:
        writer.add_add_space_prefix(config["add_prefix_space"])
    if (target_dir / "tokenizer.model").is_file():
        tokens, scores, types = sentencepiece_vocab(target_dir, vocab_size)
    elif _llama_style_tokenizer_json(target_dir):
        vocab = gguf.LlamaHfVocab(target_dir)
        tokens, scores, types = (list(column) for column in zip(*vocab.all_tokens(), strict=True))
    else:
        raise SpeculaError(f"the tokenizer of {target_dir} is neither SentencePiece (tokenizer.model) nor Llama-style "
                           "BPE; llama.cpp names such a tokenizer's pre-tokenizer from a table only its own converter "
                           "has, so give --target as the target's .gguf file (the one llama.cpp will run)")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    with _quiet("gguf.vocab"):  # its warnings about a tokenizer's pair template concern no use of the draft
        gguf.SpecialVocab(target_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        if vocab_size == 32016:  # CodeLlama: the converter names its infill tokens by id
            special = gguf.SpecialVocab(target_dir, load_merges=False,
                                        special_token_types=["prefix", "suffix", "middle", "eot"])
            for kind, token_id in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
                special._set_special_token(kind, token_id)
            special.add_to_gguf(writer, quiet=True)
    if vocab_size == 49152:  # the converter's rule for Granite's small models, applied to every 49152 vocabulary
        writer.add_add_bos_token(False)


def sentencepiece_vocab(target_dir: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and token types of ``tokenizer.model`` with the target's added tokens (converter rules)."""
    from gguf import TokenType

    pieces = read_sentencepiece_model(target_dir / "tokenizer.model")
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    # SentencePiece piece types; USER_DEFINED pieces count as NORMAL, as the converter's IsX() checks leave them
    kinds = {2: TokenType.UNKNOWN, 3: TokenType.CONTROL, 5: TokenType.UNUSED, 6: TokenType.BYTE}
    for token_id, (piece, score, kind) in enumerate(pieces[:vocab_size]):
        tokens[token_id] = piece
        scores[token_id] = score
        types[token_id] = int(kinds.get(kind, TokenType.NORMAL))

    for text, token_id in _json(target_dir / "added_tokens.json").items():
        if int(token_id) < vocab_size:
            tokens[int(token_id)] = text.encode("utf-8")
            scores[int(token_id)] = -1000.0
            types[int(token_id)] = int(TokenType.USER_DEFINED)
    decoder = _json(target_dir / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for key, data in decoder.items():
        token_id, text = int(key), data["content"]
        if token_id >= vocab_size:
            continue
        if data.get("special") or looks_special(text):
            types[token_id] = int(TokenType.CONTROL)
        else:
            text = text.replace(_SPACE_MARK, " ")
            types[token_id] = int(TokenType.USER_DEFINED)
        scores[token_id] = -1000.0
        tokens[token_id] = text.encode("utf-8")
    return tokens, scores, types


def looks_special(text: str) -> bool:
    """Whether an added token that is not marked special is a control token all the same (converter's rule)."""
    return (text in _SPECIAL_LOOKING or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def read_sentencepiece_model(path: Path) -> list[tuple[bytes, float, int]]:
    """(piece, score, type) of every piece of a SentencePiece ``ModelProto``, in id order.

    The protobuf wire format, read directly: ModelProto field 1 is the repeated
    ``SentencePiece`` message (piece = 1, string; score = 2, float; type = 3, enum with
    NORMAL = 1 the default, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6).
    """
    try:
        data = path.read_bytes()
        pieces = []
        for field, value in _proto_fields(data):
            if field != 1 or not isinstance(value, bytes):
                continue
            piece, score, kind = b"", 0.0, 1
            for sub, sub_value in _proto_fields(value):
                if sub == 1:
                    piece = sub_value
                elif sub == 2:
                    score = struct.unpack("<f", sub_value)[0]
                elif sub == 3:
                    kind = sub_value
            pieces.append((piece, score, kind))
    except (OSError, ValueError, struct.error, IndexError) as err:
        raise SpeculaError(f"cannot read the SentencePiece model {path}: {err}") from err
    if not pieces:
        raise SpeculaError(f"the SentencePiece model {path} holds no pieces")
    return pieces


def _proto_fields(data: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated protobuf message")
        yield field, value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _llama_style_tokenizer_json(target_dir: Path) -> bool:
    """What makes `gguf.LlamaHfVocab` accept tokenizer.json: BPE with byte fallback and a Sequence decoder."""
    tokenizer = _json(target_dir / "tokenizer.json")
    model = tokenizer.get("model") or {}
    return (model.get("type") == "BPE" and bool(model.get("byte_fallback"))
            and (tokenizer.get("decoder") or {}).get("type") == "Sequence")


@contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise SpeculaError(f"{path} is not a JSON object")
    return value
