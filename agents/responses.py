"""The agent server's answers (agents/openai_server.py), as OpenAI's API shapes them: the chat and completions bodies,
the log-probs of their tokens (each token's text and exact UTF-8 bytes, the engine's top k) and the usage. Functions of
the `server` (an `OpenAIServer`: its tokenizer and model name) and its recorded `Call`s; streamed answers are
agents/streaming.py's."""

import time
import uuid

from agents.records import Call
from agents.request_checks import Params


def byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's): the character a token string uses for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


def token_bytes(server, token_id: int, text: str) -> list[int]:
    """A token's UTF-8 bytes: exact for byte-level BPE (a token may hold part of a character), else its text's."""
    piece = server.tokenizer.convert_ids_to_tokens(token_id)
    if server.bytes_of is not None and token_id not in server.special_ids and all(ch in server.bytes_of
                                                                               for ch in piece):  # fmt: skip
        return [server.bytes_of[ch] for ch in piece]
    return list(text.encode("utf-8"))


def token_text(server, t: int) -> str:
    return server.tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(server, call: Call, a: int, b: int) -> dict:
    """OpenAI's `choices[i].logprobs` for generated tokens a..b: the sampled token's log-prob and bytes, and the
    engine's top k of each position, most likely first (empty unless the request asked for `top_logprobs`)."""
    ids = call.token_ids[a:b]
    tops = call.top_logprobs[a:b] if call.top_logprobs is not None else [{}] * len(ids)

    def entry(t: int, lp: float) -> dict:
        s = token_text(server, t)
        return {"token": s, "logprob": lp, "bytes": token_bytes(server, t, s)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in
                                                           sorted(top.items(), key=lambda kv: -kv[1])]}
                        for t, lp, top in zip(ids, call.logprobs[a:b], tops)]}  # fmt: skip


def completion_logprobs(server, call: Call, a: int, b: int) -> dict:
    """The legacy completions `logprobs`: tokens, their log-probs, and per token {token: log-prob} of the top k
    (`logprobs: k` > 0 in the request; None otherwise)."""
    top = None
    if call.top_logprobs is not None:
        top = [{token_text(server, u): v for u, v in sorted(d.items(), key=lambda kv: -kv[1])}
               for d in call.top_logprobs[a:b]]  # fmt: skip
    return {"tokens": server.tokenizer.convert_ids_to_tokens(call.token_ids[a:b]),
            "token_logprobs": call.logprobs[a:b], "top_logprobs": top, "text_offset": None}  # fmt: skip


def usage(calls: list[Call]) -> dict:
    n, m = len(calls[0].prompt_ids), sum(len(c.token_ids) for c in calls)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def finish_reason(call: Call) -> str:
    return "tool_calls" if call.tool_calls else call.finish_reason


def chat_response(server, calls: list[Call], p: Params) -> dict:
    choices = []
    for i, c in enumerate(calls):
        message = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        logprobs = chat_logprobs(server, c, 0, len(c.token_ids)) if p.logprobs else None
        choices.append({"index": i, "message": message, "finish_reason": finish_reason(c), "logprobs": logprobs,
                        "token_ids": c.token_ids})  # fmt: skip
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": usage(calls),
            "prompt_token_ids": calls[0].prompt_ids}  # fmt: skip


def completion_response(server, calls: list[Call], p: Params) -> dict:
    choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                "logprobs": completion_logprobs(server, c, 0, len(c.token_ids)) if p.logprobs else None}
               for i, c in enumerate(calls)]  # fmt: skip
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": usage(calls),
            "prompt_token_ids": calls[0].prompt_ids}  # fmt: skip
