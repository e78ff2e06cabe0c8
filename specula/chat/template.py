"""Chat templates: prompts through the tokenizer's chat template and the end-of-turn stop.

The prompt rule (used by `Speculator.encode`): when the tokenizer has a chat
template, a plain text prompt is the user's message (after an optional system
message), wrapped exactly as ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`` does; ``raw=True`` tokenizes the text verbatim;
``messages=[{"role": ..., "content": ...}]`` gives a whole conversation. Token
ids are always used as they are. A template's end-of-turn token joins the
target's EOS set (`end_of_turn_ids`), so an answer stops where the turn ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from specula.errors import SpeculaError

_SENTINEL = "SpeculaEndOfTurnProbe"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Ids of ``messages`` as ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives them."""
    try:
        encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    except Exception as err:  # jinja raises TemplateError (e.g. "roles must alternate") and others
        raise SpeculaError(f"the chat template rejects these messages: {str(err).splitlines()[0]}") from err
    if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding by default
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def conversation_ids(tokenizer, turns: list[str], answers: list[str], max_prompt_tokens: int) -> tuple[list[int], int]:
    """Token ids of the conversation up to the newest user turn, and how many ids were cut from the left.

    With a chat template: user/assistant messages and the generation prompt (`encode_chat`).
    Without one (stories260k, pycoder-25m): the raw texts joined with newlines,
    tokenized the way `specula generate` tokenizes a prompt.
    """
    if has_chat_template(tokenizer):
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        ids = encode_chat(tokenizer, messages)
    else:
        parts = [p for pair in zip(turns, answers + [None], strict=True) for p in pair if p is not None]
        ids = tokenizer("\n".join(parts), verbose=False).input_ids
    cut = max(0, len(ids) - max_prompt_tokens)
    return ids[cut:], cut


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of {"role": str, "content": str}, or a SpeculaError saying what is wrong."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise SpeculaError('messages must be a non-empty list of {"role": ..., "content": ...}')
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise SpeculaError(f'each message must be {{"role": str, "content": str}}, got {message!r}')
    return list(messages)


def chat_ids(tokenizer, prompt, messages=None, system: str | None = None, raw: bool = False) -> list[int] | None:
    """The prompt's ids under the prompt rule, or None where it is plain text or ids (the caller encodes it)."""
    if messages is not None:
        if prompt is not None:
            raise SpeculaError("give either a prompt or messages, not both")
        if raw:
            raise SpeculaError("raw applies to a text prompt, not to messages")
        if not has_chat_template(tokenizer):
            raise SpeculaError("messages need a chat template, and this model's tokenizer has none")
        conversation = check_messages(messages)
        if system is not None:
            if conversation[0]["role"] == "system":
                raise SpeculaError("the messages already start with a system message")
            conversation = [{"role": "system", "content": system}, *conversation]
        return encode_chat(tokenizer, conversation)
    if prompt is None:
        raise SpeculaError("the prompt is empty")
    if system is not None and (raw or not isinstance(prompt, str) or not has_chat_template(tokenizer)):
        raise SpeculaError("a system message needs a text prompt, not raw, and a model with a chat template")
    if raw or not isinstance(prompt, str) or not has_chat_template(tokenizer):
        return None
    if not prompt.strip():
        raise SpeculaError("the prompt is empty")
    turn = [{"role": "user", "content": prompt}]
    return encode_chat(tokenizer, turn if system is None else [{"role": "system", "content": system}, *turn])


def model_eos_ids(model) -> set[int]:
    """EOS ids from the model's generation config and config (what `transformers` generate stops at)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


def template_end_ids(tokenizer) -> set[int]:
    """The special token the chat template puts right after an assistant message (e.g. ``<|im_end|>``), if any."""
    if tokenizer is None or not has_chat_template(tokenizer):
        return set()
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        after = text[text.index(_SENTINEL) + len(_SENTINEL):]
        ids = tokenizer(after, add_special_tokens=False).input_ids
    except Exception:  # a template that cannot render this probe names no end token
        return set()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}
    return {ids[0]} if ids and ids[0] in special else set()


def end_of_turn_ids(tokenizer, model) -> set[int]:
    """Ids that end generation: the model's EOS and the chat template's end-of-turn token."""
    return model_eos_ids(model) | template_end_ids(tokenizer)
