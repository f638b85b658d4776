"""Chat templates as token ids: which token ends an assistant turn, and the exact tokens that continue a conversation.

A chat model is trained and sampled on the tokens of its tokenizer's chat template. Three facts are read off the
template here, by rendering a probe conversation, so that nothing re-tokenizes text the model wrote:

- `end_of_turn_id`: the special token that closes an assistant turn (`<|im_end|>` in Qwen's template, `<|eot_id|>` in
  Llama 3's, `</s>` in Mistral's). Generation stops there (`stop_ids`), whether or not it is the tokenizer's eos;
  SFT learns the turn up to and including it.
- what the template writes after that token (Qwen: `\\n`): a separator the model never generates, so it is not a
  target, and a multi-turn environment appends it before the next turn.
- `continuation_ids`: the tokens of new (user, tool) messages plus the next generation prompt, exactly as tokenizing
  the whole templated conversation gives them. They start right after a special token, and tokenizers cut text at
  special tokens before anything else, so these ids are the slice of the full conversation's ids at that place.
"""

from __future__ import annotations

_PROBE = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return ids


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with: the first token after the turn's content
    in a rendered probe conversation. None when the tokenizer has no chat template, the template cannot render a
    user + assistant exchange, or the turn ends in plain text (the embedded tokenizer's `assistant: 2\\n`)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    from jinja2 import TemplateError

    try:
        text = _render(tokenizer, _PROBE)
    except TemplateError:
        return None
    tail = text[text.rindex(_PROBE[-1]["content"]) + len(_PROBE[-1]["content"]) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    return ids[0] if ids and ids[0] in _special_ids(tokenizer) else None


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end a response: eos and the template's end-of-turn token (once each; eos first)."""
    ids = [tokenizer.eos_token_id, end_of_turn_id(tokenizer)]
    return list(dict.fromkeys(i for i in ids if i is not None))


def turn_end_ids(tokenizer) -> list[int]:
    """What a response ends with when it is learned (SFT, DPO, KTO): the template's end-of-turn token with a chat
    template whose turns end in one, else eos."""
    eot = end_of_turn_id(tokenizer)
    return [eot if eot is not None else tokenizer.eos_token_id]


def check_messages(messages, what: str) -> list[dict]:
    """`messages` as a list of {role, content} dicts with text values; ValueError naming `what` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{what} must be a non-empty list of {{role, content}} messages, got {type(messages).__name__}"
        )
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}: message {k} must be a {{role, content}} dict with text values, got {m!r}")
    return messages


def continuation_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens that follow an assistant turn which ended with `end_of_turn_id`, when `messages` (user or tool
    turns) are added and the model is to answer again: the template's separator after the turn, the new turns and
    the generation prompt. Equal to the slice of `tokenizer(whole templated conversation)` at that place.

    ValueError when the template has no special end-of-turn token (nothing to cut at), or when adding turns changes
    how the earlier ones are rendered (the new turns' tokens would then not extend the conversation's)."""
    eot = end_of_turn_id(tokenizer)
    if eot is None:
        raise ValueError("environment turns as messages need a chat template whose assistant turns end in a special "
                         "token (e.g. <|im_end|>); this tokenizer's does not: return text instead")  # fmt: skip
    check_messages(messages, "the environment's turns")
    base = _render(tokenizer, _PROBE)
    full = _render(tokenizer, _PROBE + messages, add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template renders earlier turns differently once turns are added: environment "
                         "turns cannot be appended as tokens")  # fmt: skip
    eot_text = tokenizer.convert_ids_to_tokens(eot)
    separator = base[base.rindex(eot_text) + len(eot_text) :]
    return tokenizer(separator + full[len(base) :], add_special_tokens=False)["input_ids"]
