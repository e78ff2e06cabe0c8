"""The target's tokenizer without importing `transformers`: `PlainTokenizer`, and `load_tokenizer`.

A warm start maps a plain model (`specula.runtime.plain_model`) out of the converted cache and needs nothing of
`transformers` but the tokenizer, whose import is 0.6-0.9 s of a ~2 s start on a 2-core CPU. A transformers fast
tokenizer is a `tokenizers.Tokenizer` plus a chat template and special-token bookkeeping, so `PlainTokenizer` keeps
those three: encoding and decoding run on the very `tokenizers.Tokenizer` the transformers tokenizer wraps, and the
chat template renders in a Jinja environment set up as transformers sets up its own (sandboxed, ``trim_blocks``,
``lstrip_blocks``, loop controls, ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``,
``dict``, a ``namespace`` that refuses underscore names), with the special tokens as variables.

It answers only what Specula's decoding asks (text and chat prompts, decoding, special ids, the vocabulary).
Anything else -- another option, another attribute, a message with fields beyond role and content -- goes to the
transformers tokenizer, loaded from the same files on first use. `plain_tokenizer` makes one only where it gives the
transformers tokenizer's answers on probe texts and conversations, and keeps the transformers tokenizer otherwise
(a template Jinja cannot compile here, a tokenizer that cleans up spaces after decoding, any difference).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import tokenizers


@dataclass
class Encoded:
    """What ``tokenizer(text)`` gives: the ids (``.input_ids`` or ``["input_ids"]``, as transformers' encoding)."""

    input_ids: list[int]

    def __getitem__(self, key: str) -> list[int]:
        if key != "input_ids":
            raise KeyError(key)
        return self.input_ids

    def keys(self) -> tuple[str]:
        return ("input_ids",)


class PlainTokenizer:
    """A transformers fast tokenizer's encode, decode and chat template on `tokenizers` and `jinja2` alone.

    ``backend``: the `tokenizers.Tokenizer`; ``chat_template``: the template text or None; ``special_tokens``: the
    special-token map the template sees (``bos_token`` ...); ``special_ids``: ``all_special_ids``; ``added``:
    ``added_tokens_decoder`` (id -> `tokenizers.AddedToken`); ``source``: the directory the transformers tokenizer
    loads from, for whatever this class does not answer.
    """

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None, special_tokens: dict[str, str],
                 special_ids: list[int], added: dict, source: Path):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens)
        self.all_special_ids = list(special_ids)
        self.added_tokens_decoder = dict(added)
        self.source = Path(source)
        self._template = None  # compiled on first use: Jinja templates are not pickled
        self._full = None
        self._loading = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_template", "_full", "_loading")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _template=None, _full=None, _loading=threading.Lock())

    def __getattr__(self, name: str):
        # Reached only for names this class does not define: those are the transformers tokenizer's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.full(), name)

    def full(self):
        """The transformers tokenizer these files load as (imported and loaded on first use)."""
        with self._loading:
            if self._full is None:
                self._full = transformers_tokenizer(self.source)
            return self._full

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer` (as a transformers fast tokenizer names it)."""
        return self.backend

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    def _token_id(self, role: str) -> int | None:
        token = self.special_tokens_map.get(role)
        return None if token is None else self.backend.token_to_id(token)

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True, **options) -> Encoded:
        """``text``'s ids as transformers' ``tokenizer(text, add_special_tokens=...)`` gives them."""
        if options or not isinstance(text, str):
            return self.full()(text, add_special_tokens=add_special_tokens, verbose=verbose, **options)
        return Encoded(self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True, **options) -> list[int]:
        if options or not isinstance(text, str):
            return self.full().encode(text, add_special_tokens=add_special_tokens, **options)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **options) -> str:
        """The text of ``ids`` (a list of ints, one int or a 1-D tensor)."""
        if options:
            return self.full().decode(ids, skip_special_tokens=skip_special_tokens, **options)
        ids = [ids] if isinstance(ids, int) else ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in ids if i not in special]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **options):
        """The conversation rendered by the chat template, as transformers' ``apply_chat_template`` gives it:
        text (``tokenize=False``), else an `Encoded` (``return_dict=True``, transformers 5's default) or the ids."""
        plain = (not options and self.chat_template and isinstance(conversation, list) and conversation
                 and all(isinstance(m, dict) and set(m) <= {"role", "content"}
                         and all(isinstance(v, str) for v in m.values()) for m in conversation))
        if not plain:
            return self.full().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                   tokenize=tokenize, return_dict=return_dict, **options)
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        text = self._template.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        if not tokenize:
            return text
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return Encoded(ids) if return_dict else ids


def compile_chat_template(source: str):
    """``source`` compiled in a sandboxed Jinja environment set up as transformers sets up its own."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # ``dict(...)`` and ``dict.fromkeys`` only: no attribute access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore names: nothing reaches CPython's internals
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                               dict=TemplateDict(), namespace=TemplateNamespace)
    return environment.from_string(source)


def transformers_tokenizer(model_dir: Path):
    """The tokenizer ``AutoTokenizer`` loads from ``model_dir`` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(model_dir: Path):
    """``model_dir``'s tokenizer: a `PlainTokenizer` where it answers as the transformers tokenizer does on the
    probes, else the transformers tokenizer."""
    return plain_tokenizer(transformers_tokenizer(model_dir), model_dir)


PROBE_TEXTS = ("Hello, world!", "  two leading spaces\tand a tab\nthen a newline", "café — 東京 🙂 \u00a0x",
               "<|im_end|></s><s> <|endoftext|>", "def f(x):\n    return x ** 2\n", "a" * 40)


def plain_tokenizer(full, source: Path):
    """A `PlainTokenizer` standing for the transformers tokenizer ``full`` (loaded from ``source``), or ``full``
    itself where the plain one would answer any probe differently or cannot be made."""
    backend = getattr(full, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return full
    try:
        plain = PlainTokenizer(backend, full.chat_template, full.special_tokens_map, full.all_special_ids,
                               full.added_tokens_decoder, source)
        if same_answers(plain, full):
            return plain
    except Exception:  # a template Jinja cannot compile here, an unusual tokenizer: keep the transformers one
        pass
    return full


def same_answers(plain: PlainTokenizer, full) -> bool:
    """Whether ``plain`` gives ``full``'s ids, texts and special ids on the probe texts and conversations."""
    if plain.all_special_ids != full.all_special_ids or plain.eos_token_id != full.eos_token_id:
        return False
    if getattr(full, "clean_up_tokenization_spaces", False):
        return False  # transformers edits decoded text then (for non-BPE models); not reproduced here
    for text in PROBE_TEXTS:
        for special in (True, False):
            ids = full(text, add_special_tokens=special).input_ids
            if plain(text, add_special_tokens=special).input_ids != ids:
                return False
            if any(plain.decode(ids, skip_special_tokens=s) != full.decode(ids, skip_special_tokens=s)
                   for s in (True, False)):
                return False
    if plain.chat_template:
        a, b = PROBE_TEXTS[:2]
        for conversation in ([{"role": "user", "content": a}],
                             [{"role": "system", "content": b}, {"role": "user", "content": a}],
                             [{"role": "user", "content": a}, {"role": "assistant", "content": b},
                              {"role": "user", "content": PROBE_TEXTS[2]}]):
            for generation in (True, False):
                for tokenize in (True, False):
                    expected = full.apply_chat_template(conversation, add_generation_prompt=generation,
                                                        tokenize=tokenize, return_dict=False)
                    if plain.apply_chat_template(conversation, add_generation_prompt=generation,
                                                 tokenize=tokenize, return_dict=False) != expected:
                        return False
    return True


def tokenizer_fingerprint(tokenizer) -> str:
    """What identifies a tokenizer's ids and chat template (20 hex digits): data made with another is refused."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else str(len(tokenizer)).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()[:20]
