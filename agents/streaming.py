"""Streamed answers of the agent server (agents/openai_server.py), as server-sent events: a whole answer's events in
one body (`stream`, `event_stream`), or, for a plain stream from an engine in this process, events sent while the
engine generates (`live`, `first_news`, `stream_live`), its text in pieces as the tokens decode. Functions of the
`server` (an `OpenAIServer`: its tokenizer, model name and `finish`)."""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable

from agents import responses
from agents.records import Call, Job
from agents.request_checks import Params, RequestError

STREAM_CHUNK_TOKENS = 8  # tokens per streamed chunk (more when a character spans the boundary)

log = logging.getLogger(__name__)


def event_stream(events):
    """A streamed answer: its server-sent events (all built already: the whole answer is generated before the first
    event) sent as one `text/event-stream` body. A client reads the same events in the same order as if they came one
    chunk each; one write instead of one per event saves the ASGI sends, the chunked framing and the client's reads,
    which at 16 concurrent episodes were most of what streaming cost."""
    from fastapi.responses import Response

    return Response("".join(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def pieces(server, gen: list[int], visible: str) -> list[tuple[int, int, str]]:
    """`visible` (a prefix of the text of `gen`) in streamed pieces: (first token, end token, text) per chunk of
    about `STREAM_CHUNK_TOKENS` tokens, until the text is out; the tokens after the last piece go with the final
    chunk. Each window is decoded with a few tokens of context before it, as vLLM's incremental detokenizer does,
    and the pieces are cut from `visible` itself, so they join to exactly the non-streamed text."""
    out, a, e, done = [], 0, 0, 0
    while done < len(visible) and e < len(gen):
        e = min(e + STREAM_CHUNK_TOKENS, len(gen))
        ctx = max(0, a - 4)
        before, upto = server.decode(gen[ctx:a]), server.decode(gen[ctx:e])
        if upto.endswith("\ufffd") and e < len(gen):
            continue  # a character split across tokens: wait for its last byte
        piece = visible[done : done + max(0, len(upto) - len(before))]
        if piece:
            out.append((a, e, piece))
            done, a = done + len(piece), e
    if done < len(visible):
        out.append((a, a, visible[done:]))
    return out


def stream(server, calls: list[Call], p: Params, chat: bool):
    """The server-sent events of a streamed answer (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`): per choice a
    role chunk (chat), content pieces with their tokens' ids and log-probs, and a final chunk with the tool calls,
    the remaining tokens and the finish reason; then the usage chunk when `stream_options.include_usage`."""
    head = chunk_head(server, chat)

    def event(choice: dict | None, **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': [choice] if choice else [], **extra})}\n\n"

    def logprobs(c: Call, a: int, b: int) -> dict | None:
        if not p.logprobs:
            return None
        return responses.chat_logprobs(server, c, a, b) if chat else responses.completion_logprobs(server, c, a, b)

    for i, c in enumerate(calls):
        extra = {"prompt_token_ids": c.prompt_ids} if i == 0 else {}
        if chat:
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}  # fmt: skip
            yield event(role, **extra)
            extra = {}
        end = 0
        for a, b, piece in pieces(server, c.token_ids, (c.content or "") if chat else c.text):
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            yield event({"index": i, **delta, "logprobs": logprobs(c, a, b), "finish_reason": None,
                         "token_ids": c.token_ids[a:b]}, **extra)  # fmt: skip
            extra, end = {}, b
        if chat:
            calls_delta = [{"index": j, **t} for j, t in enumerate(c.tool_calls)]
            delta = {"delta": {"tool_calls": calls_delta} if calls_delta else {}}
        else:
            delta = {"text": ""}
        yield event({"index": i, **delta, "logprobs": logprobs(c, end, len(c.token_ids)),
                     "finish_reason": responses.finish_reason(c) if chat else c.finish_reason,
                     "token_ids": c.token_ids[end:]}, **extra)  # fmt: skip
    if p.usage_chunk:
        yield event(None, usage=responses.usage(calls))
    yield "data: [DONE]\n\n"


def live(p: Params) -> bool:
    """Whether a request's stream goes out while it is generated: streamed, and its returned text is the decoded
    tokens as they come. Stop strings (the text before one is known only once it is complete), tool calls (parsed
    from the whole text) and log-probs per chunk keep the whole-answer stream (`stream`)."""
    return p.stream and not p.stops and not p.parse_tools and not p.logprobs


async def first_news(server, job: Job) -> tuple[asyncio.Future, list]:
    """Start waiting for a live request's samples and wait for the first news: a step's tokens (returned, for the
    stream's first piece) or the end. A request the engine fails on before any token raises here, so it is
    answered 500 like a plain one, not with a stream that breaks off."""
    pending = asyncio.ensure_future(server.finish(job))
    getter = asyncio.ensure_future(job.updates.get())
    await asyncio.wait({pending, getter}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():
        getter.cancel()
        await pending  # raises the engine's failure (a RequestError 500)
        return pending, []
    return pending, [getter.result()]


async def stream_live(server, job: Job, chat: bool, pending: asyncio.Future, news: list,
                       done: Callable[[], None] | None = None):  # fmt: skip
    """The server-sent events of a stream sent as the engine generates (`live`; engines in this process report
    their progress, a Ray actor's samples come whole): per choice a role chunk (chat), then content pieces as the
    tokens decode (a character split across tokens waits for its last one), then, once recorded, the rest of the
    text, the final chunk (finish reason, the tokens not yet sent) and the usage chunk. The pieces join to the
    recorded call's text, the chunks' token ids to its tokens. An engine failure after the first event ends the
    stream with an `error` event. `done`: called at the end, however the stream ends (the plain routes close their
    one-request episode)."""
    p, head = job.p, chunk_head(server, chat)
    sent, used, first = [""] * p.n, [0] * p.n, [True]

    def event(choice: dict | None, **extra) -> str:
        if first[0] and choice is not None:
            extra, first[0] = {"prompt_token_ids": job.ids, **extra}, False
        return f"data: {json.dumps({**head, 'choices': [choice] if choice else [], **extra})}\n\n"

    def piece(i: int, text: str, tokens: list[int]) -> str:
        delta = {"delta": {"content": text}} if chat else {"text": text}
        return event({"index": i, **delta, "logprobs": None, "finish_reason": None, "token_ids": tokens})

    try:
        if chat:
            for i in range(p.n):
                yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})  # fmt: skip
        while news or not pending.done():
            if not news:
                getter = asyncio.ensure_future(job.updates.get())
                await asyncio.wait({pending, getter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                news = [getter.result()]
            latest, news = dict(news), []
            while not job.updates.empty():  # the engine ran ahead of the client: only each choice's newest
                j, got = job.updates.get_nowait()
                latest[j] = got
            for j, got in sorted(latest.items()):
                text = server.decode(got)
                if text.endswith("\ufffd") or len(text) <= len(sent[j]) or not text.startswith(sent[j]):
                    continue
                yield piece(j, text[len(sent[j]) :], got[used[j] :])
                sent[j], used[j] = text, len(got)
        try:
            calls = await pending
        except RequestError as e:
            yield f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error', 'code': e.status}})}\n\n"
            return
        for i, c in enumerate(calls):
            visible = (c.content or "") if chat else c.text
            if not visible.startswith(sent[i]):  # a tokenizer whose text of a prefix is not a prefix of the text
                log.warning(f"[agents] streamed text {sent[i]!r} is not a prefix of the answer {visible!r}")
            elif len(visible) > len(sent[i]):
                yield piece(i, visible[len(sent[i]) :], [])
            delta = {"delta": {}} if chat else {"text": ""}
            yield event({"index": i, **delta, "logprobs": None,
                         "finish_reason": responses.finish_reason(c) if chat else c.finish_reason,
                         "token_ids": c.token_ids[used[i] :]})  # fmt: skip
        if p.usage_chunk:
            yield event(None, usage=responses.usage(calls))
        yield "data: [DONE]\n\n"
    finally:
        if done is not None:
            done()


def chunk_head(server, chat: bool) -> dict:
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "object": "chat.completion.chunk" if chat else "text_completion", "model": server.model_name}  # fmt: skip
