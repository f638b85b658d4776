"""The agent server as agent frameworks speak the OpenAI API (agents/openai_server.py): tool calls (Hermes format,
the template's own `tools` or the Hermes fallback), `stream`, `n > 1`, `stop` strings and logprobs, each checked to
keep the trained tokens exactly the sampled ones; and the faults: an oversized request (413), a huge prompt that must
not stall other episodes, an agent that blocks its event loop, a syntax error in the agent file.

Most tests stand a scripted engine in for vLLM (`Scripted`: it answers chosen token ids, e.g. a tool call the tiny
random model would never write, spelled one character per token so that re-tokenizing the text would give other
ids); the tests marked by the `engines` fixture run the real in-process vLLM engine over the embedded warm start."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import in_process_engines

from agents import request_checks
from agents.openai_agent import LoopWatch, OpenAIAgentExecutor, _AgentLoop, _Restart, load_agent
from agents.openai_server import SEED_STRIDE, OpenAIServer
from agents.records import build_trajectory
from agents.tool_calls import ToolParseError, parse_hermes_tool_calls, template_renders_tools
from core import embedded, models
from core.rollout import Sample

SFT = "cleanrlhf/tiny-sft"
INTEGER = {"type": "integer"}
ARGS = {"type": "object", "properties": {"a": INTEGER, "b": INTEGER}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ARGS}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(embedded.save_tiny_chat(tmp_path_factory.mktemp("chat") / "tiny-chat"))


@pytest.fixture(scope="module")
def chat_tok(chat_dir):
    return models.load_tokenizer(chat_dir)


def char_ids(tok, text: str) -> list[int]:
    """`text` one character per token: ids the model could sample, which re-tokenizing the text would not give."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]


class Scripted:
    """Stands for the engines: `reply(prompt_ids, seed)` -> token ids, each with log-prob −0.01·(position + 1), cut
    at `max_new_tokens` (`length`) or ending `stop`. Records every prompt and seed it was given."""

    def __init__(self, reply):
        self.reply, self.seen = reply, []

    def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
        out = []
        for k, p in enumerate(prompts):
            s = seed[k] if seed is not None else None
            self.seen.append((list(p), s))
            ids = list(self.reply(p, s))
            reason = "length" if len(ids) > max_new_tokens else "stop"
            ids = ids[:max_new_tokens]
            out.append([Sample(ids, [-0.01 * (t + 1) for t in range(len(ids))], reason, reason == "length")])
        return out


def serve(engine, tok, **kw) -> OpenAIServer:
    server = OpenAIServer(engine, tok, "chat", max_new_tokens=kw.pop("max_new_tokens", 256),
                          max_context=kw.pop("max_context", 4096), **kw)  # fmt: skip
    server.start()
    return server


def client_for(server: OpenAIServer, eid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.episode_url(eid), api_key="unused", max_retries=0)


def model_part(calls, k: int, tokens: list[int]) -> list[int]:
    """The trajectory tokens of chain call k's generation (`tokens` is build_trajectory's)."""
    _, _, _, mask, _ = build_trajectory(calls)
    runs, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    return (runs + [cur] if cur else runs)[k]


# ------------------------------------------------------------------------------------------------- tool calls
def test_the_hermes_parser_reads_calls_and_refuses_broken_markup():
    assert parse_hermes_tool_calls("just text") == ("just text", [])
    two = f'Let me add.\n{CALL}\n<tool_call>\n{{"name": "mul", "arguments": "{{\\"x\\": 3}}"}}'  # no </tool_call>
    assert parse_hermes_tool_calls(two) == ("Let me add.", [("add", {"a": 1, "b": 2}), ("mul", {"x": 3})])
    assert parse_hermes_tool_calls(CALL + " trailing words") == (None, [("add", {"a": 1, "b": 2})])
    assert parse_hermes_tool_calls('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", {})])
    for bad, why in [('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not JSON"),
                     ('<tool_call>["add"]</tool_call>', "\"name\" string"),
                     ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "not an object"),
                     (CALL + '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "tool call 1")]:  # fmt: skip
        with pytest.raises(ToolParseError, match=why):
            parse_hermes_tool_calls(bad)


def test_tool_calls_round_trip_and_the_trajectory_keeps_the_sampled_ids(chat_tok):
    """tiny-chat's template ignores `tools`: the server writes them in the Hermes layout. The model's call (spelled
    one character per token) comes back as `message.tool_calls`; the agent sends that message and the tool's result
    back; the second call continues the first, and the trajectory holds the first answer's ids exactly as sampled."""
    tok = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first = char_ids(tok, "Let me add.\n" + CALL) + [im_end]
    final = char_ids(tok, "It is 3.") + [im_end]
    assert first[:-1] != tok("Let me add.\n" + CALL, add_special_tokens=False)["input_ids"]  # not the canonical ids
    engine = Scripted(lambda p, s: first if len(engine.seen) == 1 else final)
    server = serve(engine, tok)
    assert not template_renders_tools(tok)
    try:
        eid = server.open_episode(1.0, 0)
        history = [{"role": "user", "content": "What is 1+2?"}]

        async def conversation():
            client = client_for(server, eid)
            out = await client.chat.completions.create(model="chat", messages=history, tools=[ADD])
            message = out.choices[0].message
            history.append(message.model_dump(exclude_none=True))
            history.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"})
            return out, await client.chat.completions.create(model="chat", messages=history, tools=[ADD])

        out, second = asyncio.run(conversation())
        log = server.close_episode(eid)
    finally:
        server.close()
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 1, "b": 2}  # fmt: skip
    assert second.choices[0].message.content == "It is 3." and second.choices[0].finish_reason == "stop"
    c1, c2 = log.calls
    assert "<tools>\n" + json.dumps(ADD) in c1.prompt_text and c1.prompt_text.startswith("<|im_start|>system\n# Tools")
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in c2.prompt_text
    assert log.tool_calls == 1 and log.tool_parse_errors == 0 and c2.parent == 0
    prompt, tokens, logprobs, mask, dropped = build_trajectory(log.calls)
    between = c2.prompt_ids[len(c1.prompt_ids) + len(first) :]
    assert dropped == 0 and prompt == c1.prompt_ids
    assert tokens == first + between + final  # the sampled ids, <|im_end|> included; nothing re-tokenized
    assert mask == [1] * len(first) + [0] * len(between) + [1] * len(final)
    assert logprobs[: len(first)] == c1.logprobs and tok.decode(between).startswith("\n<|im_start|>user\n<tool_resp")


NATIVE_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\\nTOOLS ' + (tools | tojson) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') -}}"
    "{%- for c in m.get('tool_calls', []) -%}{{- 'CALL ' + c['function']['name'] + ' ' + "
    "(c['function']['arguments'] | tojson) -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_a_template_that_renders_tools_gets_them_and_tool_choice_is_checked(chat_dir):
    """A template with its own tool layout gets `tools` and the agent's own assistant tool calls (arguments as an
    object, as Hugging Face templates expect); `tool_choice: none` renders no tools and parses nothing; a named or
    required choice is accepted (not enforced: the model's answer is parsed as for `auto`); bad ones are 400."""
    tok = models.load_tokenizer(chat_dir)
    tok.chat_template = NATIVE_TEMPLATE
    assert template_renders_tools(tok)
    server = serve(Scripted(lambda p, s: char_ids(tok, CALL)), tok)
    few_shot = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "x1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
                {"role": "tool", "tool_call_id": "x1", "content": "2"},
                {"role": "user", "content": "1+2?"}]  # fmt: skip
    try:
        eid = server.open_episode(1.0, 0)

        async def requests():
            client, out = client_for(server, eid), []
            for choice in ["auto", "none", "required", {"type": "function", "function": {"name": "add"}}]:
                r = await client.chat.completions.create(model="chat", messages=few_shot, tools=[ADD],
                                                         tool_choice=choice)  # fmt: skip
                out.append(r.choices[0])
            for kw in [dict(tool_choice={"type": "function", "function": {"name": "mul"}}, tools=[ADD]),
                       dict(tool_choice="sometimes", tools=[ADD]), dict(tool_choice="required"),
                       dict(tools=[{"type": "function", "function": {}}]),
                       dict(extra_body={"functions": [ADD["function"]]})]:  # fmt: skip
                try:
                    await client.chat.completions.create(model="chat", messages=few_shot, **kw)
                except openai.BadRequestError as e:
                    out.append(e)
            return out

        auto, none, required, named, *errors = asyncio.run(requests())
        log = server.close_episode(eid)
    finally:
        server.close()
    assert log.calls[0].prompt_text.startswith("<|im_start|>system\nTOOLS [{")
    assert 'CALL add {"a": 1, "b": 1}<|im_end|>' in log.calls[0].prompt_text  # the agent's own call, an object
    assert "TOOLS" not in log.calls[1].prompt_text and none.finish_reason == "stop" and none.message.content == CALL
    for c in (auto, required, named):
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "add"
    assert [type(e) for e in errors] == [openai.BadRequestError] * 5
    for e, words in zip(errors, ["names no function", "must be 'auto'", "needs 'tools'", "'tools' must be",
                                 "legacy"]):  # fmt: skip
        assert words in str(e), (words, e)


def test_an_unparseable_tool_call_is_text_counted_and_logged_by_the_executor(chat_tok, tmp_path, caplog):
    """A broken `<tool_call>` comes back as plain content (finish_reason as generated), never a 500; the episode
    log counts it and the executor reports `rollout/tool_parse_errors_mean` and one warning line."""
    tok = chat_tok
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1</tool_call>'
    agent = tmp_path / "tool_agent.py"
    agent.write_text(
        "TOOLS = [{'type': 'function', 'function': {'name': 'add', 'parameters': {'type': 'object'}}}]\n"
        "async def agent(client, example):\n"
        "    out = await client.chat.completions.create(model='policy', tools=TOOLS,\n"
        "                                               messages=[{'role': 'user', 'content': example['prompt']}])\n"
        "    m = out.choices[0].message\n"
        "    return 1.0 if m.tool_calls else 0.5 if m.content.startswith('<tool_call>') else 0.0\n"
    )  # fmt: skip
    engine = Scripted(lambda p, s: char_ids(tok, broken if s % 2 else CALL) + [tok.eos_token_id])
    ex = OpenAIAgentExecutor(engine, tok, str(agent), "chat", max_new_tokens=256, max_context=4096)
    rows = [{"prompt": "1+2?", "prompt_ids": tok("1+2?")["input_ids"], "label": "3"}]
    try:
        with caplog.at_level(logging.WARNING, logger="agents.openai_agent"):
            ro = ex.run(rows, n=4, seed=0, step=2)
    finally:
        ex.close()
    assert ro.rewards.tolist() == [1.0, 0.5, 1.0, 0.5] and ro.logs["rollout/agent_errors"] == 0
    assert ro.logs["rollout/tool_parse_errors_mean"] == 0.5 and ro.logs["rollout/agent_tool_calls_mean"] == 0.5
    for i, e in enumerate(ro.episodes):  # episode i samples with seed i; a broken answer trains as sampled
        assert e.token_ids == char_ids(tok, broken if i % 2 else CALL) + [tok.eos_token_id]
        assert e.action_mask == [1] * len(e.token_ids)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "agents.openai_agent"]
    assert "2 answers of step 2 wrote tool calls that do not parse" in line and "not JSON" in line


# ------------------------------------------------------------------------------------------------- streaming
def test_prompts_tokenized_by_pieces_are_the_whole_prompts_ids_and_the_tools_turn_is_tokenized_once(chat_tok):
    """The server tokenizes a chat prompt in pieces cut before each added token, keeping the pieces' ids: the same ids
    as the whole text for random texts around the template's special tokens (spaces, newlines and non-ASCII next to
    them), and a system turn that every episode sends is tokenized once."""
    import random

    server = OpenAIServer(Scripted(lambda p, s: [2]), chat_tok, "chat", max_new_tokens=8, max_context=4096)
    assert server._piece_split is not None
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "  ", "\n", "\n\n", "é", "ü", "12", "+", "<", "|", ">", "tool", "_call", "{", "}", "\t"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    for _ in range(300):
        text = "".join(rng.choice(specials) if rng.random() < 0.15 else rng.choice(alphabet)
                       for _ in range(rng.randint(1, 40)))  # fmt: skip
        assert server._encode(text, False) == chat_tok(text, add_special_tokens=False)["input_ids"], repr(text)
    assert server._piece_split is not None  # no difference seen: still by pieces
    tools = [{"type": "function", "function": {"name": "calculator", "description": "adds",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    log = server.episodes[server.open_episode(1.0, 0)]
    p = request_checks.check_params({"model": "chat", "tools": tools}, True, server.model_name, server.max_new_tokens)
    before = server._piece_ids.cache_info()
    prompts = [server.chat_prompt(log, {"messages": [{"role": "user", "content": f"{a}+{a}="}]}, p) for a in (1, 2, 3)]
    after = server._piece_ids.cache_info()
    for ids, _, text in prompts:
        assert ids == chat_tok(text, add_special_tokens=False)["input_ids"]
    assert after.hits - before.hits >= 2  # the tools' system turn, tokenized for the first prompt only


def test_a_tokenizer_whose_pieces_differ_from_the_whole_is_caught_and_whole_prompts_are_tokenized(chat_tok, caplog):
    server = OpenAIServer(Scripted(lambda p, s: [2]), chat_tok, "chat", max_new_tokens=8, max_context=4096)
    server._piece_split = re.compile("(?=ber)")  # cuts inside words: the pieces' merges differ from the whole's
    text = "the number is a member of the numbers"
    whole = chat_tok(text, add_special_tokens=False)["input_ids"]
    pieces = [t for piece in server._piece_split.split(text) for t in chat_tok(piece)["input_ids"]]
    assert pieces != whole  # the premise: this split changes the ids
    with caplog.at_level(logging.WARNING, logger="agents.openai_server"):
        assert server._encode(text, False) == whole
    assert server._piece_split is None and "tokenizes whole prompts from now on" in caplog.text
    assert server._encode(text, False) == whole


def test_a_streamed_answer_is_the_same_recorded_call_in_chunks(chat_tok):
    """`stream: true` sends the call the non-streamed request records (same seed, same ids, same log-probs): the
    content pieces join to the non-streamed content, the chunks' token ids and log-probs to the recorded ones, the
    tool call comes as a delta, the events are `data: {...}` lines ending with `data: [DONE]`, and the trajectory
    is the scripted ids."""
    tok = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    text = "Sure: héllo wörld, the answer is three plus four. " * 2
    reply = char_ids(tok, text + CALL) + [im_end]
    server = serve(Scripted(lambda p, s: reply), tok)
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        plain, streamed, raw = server.open_episode(1.0, 5), server.open_episode(1.0, 5), server.open_episode(1.0, 5)

        async def both():
            whole = await client_for(server, plain).chat.completions.create(
                model="chat", messages=messages, tools=[ADD], logprobs=True)  # fmt: skip
            chunks = [c async for c in await client_for(server, streamed).chat.completions.create(
                model="chat", messages=messages, tools=[ADD], logprobs=True, stream=True,
                stream_options={"include_usage": True})]  # fmt: skip
            async with httpx.AsyncClient(trust_env=False) as http:
                r = await http.post(server.episode_url(raw) + "/completions", json={
                    "model": "chat", "prompt": "Say hello.", "stream": True, "logprobs": 0})  # fmt: skip
            return whole, chunks, r

        whole, chunks, events = asyncio.run(both())
        (c_plain,), (c_stream,) = server.close_episode(plain).calls, server.close_episode(streamed).calls
        (c_raw,) = server.close_episode(raw).calls
    finally:
        server.close()
    assert (c_plain.prompt_ids, c_plain.token_ids, c_plain.logprobs) == (c_stream.prompt_ids, c_stream.token_ids,
                                                                          c_stream.logprobs)  # fmt: skip
    assert c_stream.token_ids == reply and build_trajectory([c_stream])[1] == reply
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant" and len(choices) > 4  # streamed in pieces, not one chunk
    assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content == text.rstrip()
    assert sum((c.model_extra["token_ids"] for c in choices[1:]), []) == reply
    assert [t.logprob for c in choices if c.logprobs for t in c.logprobs.content] == c_plain.logprobs
    (delta,) = choices[-1].delta.tool_calls
    assert (delta.index, delta.id, delta.function.name) == (0, c_stream.tool_calls[0]["id"], "add")
    assert choices[-1].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens == len(reply)
    assert chunks[0].model_extra["prompt_token_ids"] == c_stream.prompt_ids
    lines = [line for line in events.text.split("\n\n") if line]
    assert events.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1])
    pieces = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    assert "".join(p["text"] for p in pieces) == c_raw.text and pieces[-1]["finish_reason"] == "stop"
    assert sum((p["logprobs"]["token_logprobs"] for p in pieces), []) == c_raw.logprobs


@pytest.fixture
def chat_engines(chat_dir, one_thread):
    """Its own in-process vLLM engine, shut down after the test (the module's later tests do not need it)."""
    yield from in_process_engines(chat_dir, "float32")


def test_a_stream_goes_out_as_the_engine_generates_and_is_the_whole_answer(chat_engines, chat_tok):
    """A streamed chat answer of 64 tokens from the in-process vLLM engine on tiny-chat, read by the official client:
    its first content arrives within 20 % of the whole answer's time (the engine reports every step; the stream was
    whole before its first event), and the pieces join to the answer the same request gets without `stream` (same
    seed: the same text and token ids)."""
    server = serve(chat_engines, chat_tok, max_new_tokens=64)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "chat", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 64}

    async def streamed(seed: int) -> tuple[float, float, str, list[int]]:
        t0, first, text, ids = time.perf_counter(), None, "", []
        async for chunk in await client.chat.completions.create(**ask, seed=seed, stream=True):
            for c in chunk.choices:
                if c.delta.content and first is None:
                    first = time.perf_counter() - t0
                text += c.delta.content or ""
                ids += c.model_extra.get("token_ids") or []
        return first, time.perf_counter() - t0, text, ids

    async def run():
        for seed in range(20):  # the random model may end early: a seed whose answer runs to the limit
            whole = await client.chat.completions.create(**ask, seed=seed)
            if len(whole.choices[0].model_extra["token_ids"]) == 64:
                break
        return whole, seed, [await streamed(seed) for _ in range(3)]

    try:
        whole, seed, runs = asyncio.run(run())
    finally:
        server.close()
    assert len(whole.choices[0].model_extra["token_ids"]) == 64, seed
    for _, _, text, ids in runs:
        assert text == whole.choices[0].message.content and ids == whole.choices[0].model_extra["token_ids"]
    ratios = sorted(first / total for first, total, _, _ in runs)
    print(f"\nfirst content / whole answer (s): {[(round(f, 3), round(t, 3)) for f, t, _, _ in runs]}")
    assert ratios[1] <= 0.2, runs  # the median of three


def test_a_live_stream_the_engine_fails_on_before_any_token_is_answered_500(chat_tok):
    """A streamed request that goes out as it is generated (no tools, stops or log-probs) waits for the engine's
    first news before it answers: a failure then is a 500 with the engine's error, as for a plain request, not a
    stream that breaks off; the next request is served."""
    calls = []

    class FailsOnce:
        def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
            calls.append(len(prompts))
            if len(calls) == 1:
                raise RuntimeError("the engine broke")
            return [[Sample([5, 6], [-0.1, -0.2], "length", True)] for _ in prompts]

    server = serve(FailsOnce(), chat_tok)
    ask = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="the engine broke"):
            await client.chat.completions.create(**ask)
        return [c async for c in await client.chat.completions.create(**ask)]

    try:
        chunks = asyncio.run(run())
    finally:
        server.close()
    assert sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks if c.choices), []) == [5, 6]
    assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------------------------------------- n
def test_n_choices_are_calls_and_the_one_the_agent_continues_is_trained(chat_tok):
    """n=3: three recorded calls on one prompt with seeds seed + 7919·k; the agent continues choice 2 (sends its
    text back), so the next call's parent is choice 2 and the trajectory is choice 2's ids then the new answer;
    choices 0 and 1 are dropped. An episode that ends on an n=3 request trains its choice 0."""
    tok = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    engine = Scripted(lambda p, s: char_ids(tok, f"I pick {words[(s // SEED_STRIDE) % 5]}.") + [im_end])
    server = serve(engine, tok)
    try:
        eid, last = server.open_episode(1.0, 0), server.open_episode(1.0, 0)

        async def play():
            client, history = client_for(server, eid), [{"role": "user", "content": "Pick one."}]
            out = await client.chat.completions.create(model="chat", messages=history, n=3)
            history += [{"role": "assistant", "content": out.choices[2].message.content},
                        {"role": "user", "content": "Why?"}]  # fmt: skip
            await client.chat.completions.create(model="chat", messages=history)
            await client_for(server, last).chat.completions.create(model="chat", messages=history[:1], n=3)
            return out

        out = asyncio.run(play())
        log, ended = server.close_episode(eid), server.close_episode(last)
    finally:
        server.close()
    assert [c.message.content for c in out.choices] == ["I pick alpha.", "I pick beta.", "I pick gamma."]
    assert [s for _, s in engine.seen[:4]] == [0, SEED_STRIDE, 2 * SEED_STRIDE, 3 * SEED_STRIDE]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in log.calls[:3])
    assert [(c.request, c.choice) for c in log.calls] == [(0, 0), (0, 1), (0, 2), (3, 0)]
    assert log.calls[3].parent == 2
    prompt, tokens, _, mask, dropped = build_trajectory(log.calls)
    assert dropped == 2 and prompt == log.calls[0].prompt_ids
    assert tokens[: len(log.calls[2].token_ids)] == log.calls[2].token_ids == char_ids(tok, "I pick gamma.") + [im_end]
    assert tokens[-len(log.calls[3].token_ids) :] == log.calls[3].token_ids
    _, tokens, _, _, dropped = build_trajectory(ended.calls)
    assert dropped == 2 and tokens == ended.calls[0].token_ids  # the last request's choice 0


# ------------------------------------------------------------------------------------------------------ stop
def test_a_chat_turn_cut_at_a_stop_string_trains_only_the_text_it_returned(chat_tok):
    """stop "\\nObservation": the call keeps the sampled ids up to and including the one completing the stop string;
    the answer leaves the stop string out; when the agent sends the answer back (the template closes the turn with
    `<|im_end|>`, which the model did not write), the trajectory keeps the ids of the returned text only."""
    tok = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    kept, cut = "Action: add(1, 2)", "\nObservation"
    engine = Scripted(lambda p, s: char_ids(tok, kept + cut + ": made up") + [im_end])
    server = serve(engine, tok)
    try:
        eid = server.open_episode(1.0, 0)
        history = [{"role": "user", "content": "1+2?"}]

        async def play():
            client = client_for(server, eid)
            out = await client.chat.completions.create(model="chat", messages=history, stop=["\n\n", cut])
            history.extend([{"role": "assistant", "content": out.choices[0].message.content},
                            {"role": "user", "content": "Observation: 3"}])  # fmt: skip
            await client.chat.completions.create(model="chat", messages=history, stop=cut)
            return out

        out = asyncio.run(play())
        c1, c2 = server.close_episode(eid).calls
    finally:
        server.close()
    sampled = char_ids(tok, kept + cut)
    assert out.choices[0].message.content == kept and out.choices[0].finish_reason == "stop"
    assert c1.token_ids == sampled and c1.logprobs == [-0.01 * (t + 1) for t in range(len(sampled))]
    assert (c1.text, c1.stop_text, c1.text_tokens) == (kept, cut, len(char_ids(tok, kept)))
    assert c2.parent == 0
    _, tokens, _, mask, dropped = build_trajectory([c1, c2])
    n = len(char_ids(tok, kept))
    assert dropped == 0 and tokens[:n] == sampled[:n] and mask[:n] == [1] * n and mask[n] == 0
    assert tok.decode(tokens[n:]).startswith("<|im_end|>\n<|im_start|>user\nObservation: 3")


# --------------------------------------------------------------------------------------------------- logprobs
def test_chat_logprobs_give_each_tokens_bytes(chat_tok):
    """`logprobs.content[j]`: the token's text, the sampled log-prob, its exact UTF-8 bytes (a byte-level token may
    hold half a character: the bytes of all tokens join to the text) and an empty `top_logprobs` (the engines return
    only the sampled token's log-prob)."""
    tok = chat_tok
    reply = tok("é ok", add_special_tokens=False)["input_ids"]
    server = serve(Scripted(lambda p, s: reply), tok)
    try:
        eid = server.open_episode(1.0, 0)
        out = asyncio.run(client_for(server, eid).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3))  # fmt: skip
        server.close_episode(eid)
    finally:
        server.close()
    content = out.choices[0].logprobs.content
    assert [t.logprob for t in content] == [-0.01 * (t + 1) for t in range(len(reply))]
    assert bytes(b for t in content for b in t.bytes).decode() == "é ok" and all(t.top_logprobs == [] for t in content)


# ---------------------------------------------------------------------------------------- the real vLLM engine
@pytest.fixture(scope="module")
def sft_path():
    return str(embedded.ensure_sft_warm_start())


@pytest.fixture(scope="module")
def engines(sft_path, one_thread):
    yield from in_process_engines(sft_path, "float32")


@pytest.fixture(scope="module")
def sft_tok(sft_path):
    return models.load_tokenizer(sft_path)


def test_n_choices_and_stop_strings_keep_exactly_the_engines_tokens(engines, sft_tok):
    """On the real engine: choice k of an n=4 request is the engine's sample with seed + 7919·k, token for token;
    a stop string cuts the sample where vLLM's own `stop` does (`SamplingParams(stop=..., detokenize=True)`, which the
    rollout path does not use: it generates with `detokenize=False`), keeping the same ids and log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    server = OpenAIServer(engines, sft_tok, SFT, max_new_tokens=8, max_context=64)
    server.start()
    try:
        eid = server.open_episode(1.0, 100)
        prompt = "12+30="
        out = asyncio.run(client_for(server, eid).completions.create(model=SFT, prompt=prompt, n=4, max_tokens=8))
        calls = server.close_episode(eid).calls
        ids = sft_tok.encode(prompt)
        direct = engines.generate([ids] * 4, n=1, max_new_tokens=8, temperature=1.0,
                                  seed=[100 + SEED_STRIDE * k for k in range(4)])  # fmt: skip
        assert [c.token_ids for c in calls] == [d[0].token_ids for d in direct]
        assert [c.text for c in out.choices] == [c.text for c in calls]
        # stop strings: the first digit the four samples wrote after their first character, and a "9"
        stops = sorted({sft_tok.decode(c.token_ids, skip_special_tokens=True)[1:2] for c in calls} - {""})[:1] + ["9"]
        eid = server.open_episode(1.0, 100)
        cut = asyncio.run(client_for(server, eid).completions.create(model=SFT, prompt=prompt, n=4, max_tokens=8,
                                                                     stop=stops))  # fmt: skip
        cut_calls = server.close_episode(eid).calls
    finally:
        server.close()
    vllm = engines.engines[0]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + SEED_STRIDE * k, logprobs=0, flat_logprobs=True,
                             stop=stops, include_stop_str_in_output=True, stop_token_ids=vllm.stop_token_ids)
              for k in range(4)]  # fmt: skip
    own = vllm.llm.generate([TokensPrompt(prompt_token_ids=ids)] * 4, params, use_tqdm=False)
    assert any(c.finish_reason == "stop" and c.stop_text in stops for c in cut_calls), "no stop string was hit"
    for c, full, o, choice in zip(cut_calls, calls, own, cut.choices):
        assert c.token_ids == list(o.outputs[0].token_ids) == full.token_ids[: len(c.token_ids)]
        assert c.logprobs == pytest.approx(full.logprobs[: len(c.token_ids)], abs=1e-6)
        assert choice.text == c.text and not any(s in c.text for s in stops)
        if c.stop_text in stops:
            assert o.outputs[0].stop_reason == c.stop_text and choice.finish_reason == "stop"


# ----------------------------------------------------------------------------------------------------- faults
def test_a_request_over_the_size_limit_is_413_and_the_server_goes_on(chat_tok):
    server = serve(Scripted(lambda p, s: [5, 6]), chat_tok, max_request_bytes=100_000)
    try:
        eid = server.open_episode(1.0, 0)

        async def requests():
            client = client_for(server, eid)
            with pytest.raises(openai.APIStatusError) as big:
                await client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "x" * 200_000}]
                )
            small = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
            return big.value, small

        big, small = asyncio.run(requests())
        log = server.close_episode(eid)
    finally:
        server.close()
    assert big.status_code == 413 and "over the server's limit of 100000 (max_request_bytes)" in str(big)
    assert small.choices[0].finish_reason == "stop" and log.bad_requests == 1 and len(log.calls) == 1


def test_a_huge_prompt_is_tokenized_off_the_event_loop_and_other_episodes_go_on(chat_tok):
    """A 2 MB chat prompt takes seconds to tokenize; meanwhile a small request of another episode is answered in
    well under a second (it would wait for the whole tokenization if it ran on the server's event loop)."""
    tok = chat_tok
    server = serve(Scripted(lambda p, s: [5, 6]), tok, max_context=1024)
    encoded, original = [], server._encode

    def encode(text, special):
        if len(text) > 1_000_000:
            encoded.append(time.monotonic())
            ids = original(text, special)
            encoded.append(time.monotonic())
            return ids
        return original(text, special)

    server._encode = encode
    try:
        huge, small = server.open_episode(1.0, 0), server.open_episode(1.0, 0)

        async def both():
            big = asyncio.create_task(client_for(server, huge).chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "What is 1+2? " * 160_000}]))  # fmt: skip
            while not encoded and not big.done():
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            await client_for(server, small).chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}]
            )
            t1 = time.monotonic()
            with pytest.raises(openai.BadRequestError, match="no room to generate"):
                await big
            return t0, t1

        t0, t1 = asyncio.run(both())
        server.close_episode(huge)
        server.close_episode(small)
    finally:
        server.close()
    assert t1 - t0 < 1.0 and t1 < encoded[1], (t1 - t0, encoded[1] - encoded[0])


BLOCKING_AGENT = """
import time

async def agent(client, example):
    await client.completions.create(model="policy", prompt=example["prompt"])
    if example["label"] == "sleep":
        time.sleep(30)
    if example["label"] == "spin":
        while True:
            pass
    return 1.0
"""


def labelled(tok, labels: list[str]) -> list[dict]:
    """One row per label, all the same prompt: the test agents act on `example["label"]`."""
    return [{"prompt": "37+05=", "prompt_ids": tok.encode("37+05="), "label": k} for k in labels]


def test_an_agent_that_blocks_its_event_loop_times_out_and_the_run_goes_on(sft_tok, tmp_path):
    """`time.sleep` and a CPU loop inside `async def agent` (nothing else on its loop runs while they hold it): the
    blocking agents get loops of their own, so both end at the timeout naming the file and line, the good episodes
    train, and the spinning thread is stopped a second later."""
    path = tmp_path / "blocking_agent.py"
    path.write_text(BLOCKING_AGENT)
    ex = OpenAIAgentExecutor(Scripted(lambda p, s: [5, 6, 2]), sft_tok, str(path), SFT, 8, 64, timeout_s=1.0)
    batch = labelled(sft_tok, ["ok", "sleep", "spin"])
    try:
        t0 = time.monotonic()
        ro = ex.run(batch, n=2, seed=0, step=1)
        wall = time.monotonic() - t0
    finally:
        ex.close()
    assert wall < 5.0, wall
    assert ro.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and ro.logs["rollout/agent_timeouts"] == 4
    assert [e.finish_reason for e in ro.episodes] == ["stop", "stop"] + ["agent_timeout"] * 4
    # the spinners' threads are stopped about a second after their timeout (on a loaded 2-core machine it took longer
    # than 5 s); the two sleepers wake only 30 s after they started, so waiting up to 20 s still sees them. What every
    # agent thread left runs is read from its stack: no spinner's line, and each sleeper's line once (an episode
    # restarted elsewhere runs none of its code on the loop it left: the test above). A spinner's thread that has left
    # the agent's code but not yet ended reads as None: it is waited for too (a full suite run once saw [7, 7, None]).
    deadline = time.monotonic() + 20
    while any(line != SLEEP_LINE for line in agent_lines(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = agent_lines(path)
    assert lines == [SLEEP_LINE] * 2, (lines, agent_threads())


def test_an_episode_restarted_elsewhere_runs_no_more_of_its_agent_on_the_loop_it_left():
    """The shared loop is left to episode A, which blocks it, while B's next step is already queued on it (both awaited
    one event; A's step came first and blocks). B restarts elsewhere (`_Restart`), so once A lets the loop go, B's
    queued step must not run B's code there: it gets `CancelledError` at its `await` instead."""
    ran: list[str] = []

    async def main():
        worker = _AgentLoop(shared=True)
        gate = asyncio.Event()

        async def agent(name: str, hold_s: float):
            await gate.wait()
            ran.append(name)
            time.sleep(hold_s)  # A holds the loop; B's wake-up waits behind it
            return name

        a = worker.start(lambda: agent("A", 0.5), "A")
        b = worker.start(lambda: agent("B", 0.0), "B")
        await asyncio.sleep(0.05)  # both await the gate, A first
        worker.loop.call_soon_threadsafe(gate.set)  # wakes A, then B, in that order
        while worker.blocking_episode() != "A":
            await asyncio.sleep(0.005)
        assert worker.give_to("A") == ["B"]
        with pytest.raises(_Restart):
            await b
        assert await a == "A"
        await asyncio.sleep(0.2)  # B's queued step has run by now (the loop is free)
        worker.stop()

    asyncio.run(main())
    assert ran == ["A"], ran


SLEEP_LINE, SPIN_LINES = 7, (9, 10)  # BLOCKING_AGENT's `time.sleep(30)` and `while True: pass`


def agent_lines(path) -> list[int | None]:
    """The line of `path` each live agent thread runs now (None: not inside the file), read as the executor's watch
    reads a blocked loop's (`LoopWatch.blocked_at`)."""
    where = [LoopWatch(None, t).blocked_at(Path(path).resolve()) for t in agent_threads()]
    return [None if w is None else int(w.split()[1]) for w in where]


def agent_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("agent-") and t.is_alive()]


def test_the_timeout_message_names_where_the_agent_blocks(sft_tok, tmp_path):
    path = tmp_path / "spin_agent.py"
    path.write_text("async def agent(client, example):\n    x = 0\n    while True:\n        x += 1\n")
    ex = OpenAIAgentExecutor(Scripted(lambda p, s: [5, 2]), sft_tok, str(path), SFT, 8, 64, timeout_s=0.5)
    try:
        reward, error = asyncio.run(ex._play(ex.server.open_episode(1.0, 0), {"prompt": "1+1="}))
    finally:
        ex.close()
    assert reward == 0.0 and error[0] == "timeout"
    assert "did not return within 0.5 s (--rollout.agent-timeout-s)" in error[1]
    assert f"blocking its event loop at {path} line " in error[1] and "(agent)" in error[1]


PAUSING_AGENT = """
import time

async def agent(client, example):
    first = await client.completions.create(model="policy", prompt=example["prompt"])
    if example["label"] == "pause":
        time.sleep(0.8)  # blocks the loop it runs on, for less than the timeout
    second = await client.completions.create(model="policy", prompt=example["prompt"] + first.choices[0].text)
    return 1.0
"""


def test_agents_share_one_loop_until_one_blocks_it_and_the_others_restart_with_the_same_samples(sft_tok, tmp_path,
                                                                                                 caplog):  # fmt: skip
    """Episodes that never block run on one agent loop (one thread, not one per episode). An agent that blocks that
    loop (`time.sleep(0.8)`, over `block_s` = 0.5 s, under the 3 s timeout) gets it to itself: the episodes stuck
    behind it start again on a new shared loop and sample exactly what they would have (the same seeds), the blocking
    one still returns, every episode's reward counts, and a warning names the line where it blocked. When agents
    block a second time, every episode gets a loop of its own from then on."""
    path = tmp_path / "pausing_agent.py"
    path.write_text(PAUSING_AGENT)

    def reply(prompt, seed):  # the tokens depend on the call's seed
        return [5 + seed % 5, 6 + seed % 3, 2]

    def run(labels):
        engine = Scripted(reply)
        ex = OpenAIAgentExecutor(engine, sft_tok, str(path), SFT, 8, 64, timeout_s=3.0)
        batch = labelled(sft_tok, labels)
        before = set(agent_threads())
        try:
            ro = ex.run(batch, n=1, seed=100, step=1)
            threads = set(agent_threads()) - before
        finally:
            ex.close()
        return ro, ex, threads

    def same_samples(ro, ref):
        assert ro.rewards.tolist() == [1.0] * 6 and ro.logs["rollout/agent_errors"] == 0
        assert [e.token_ids for e in ro.episodes] == [e.token_ids for e in ref.episodes]
        assert [e.prompt_ids for e in ro.episodes] == [e.prompt_ids for e in ref.episodes]
        assert ro.logs["rollout/agent_dropped_calls"] == 0  # a restarted episode's first attempt left no call behind

    calm, ex, threads = run(["ok"] * 6)
    assert ex.blocks == 0 and not ex.isolated and [t.name for t in threads] == ["agent-loop-shared"]
    assert calm.rewards.tolist() == [1.0] * 6
    with caplog.at_level(logging.WARNING, logger="agents.openai_agent"):
        paused, ex, threads = run(["ok"] * 5 + ["pause"])
    same_samples(paused, calm)
    assert ex.blocks == 1 and not ex.isolated and {t.name for t in threads} == {"agent-loop-shared"}
    warning = next(r.getMessage() for r in caplog.records if "held the agents' event loop" in r.getMessage())
    assert str(path) in warning and "for over 0.5 s at line 7 (agent)" in warning
    assert int(re.search(r"(\d+) episodes that shared the loop start again on a new one", warning)[1]) >= 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agents.openai_agent"):
        twice, ex, threads = run(["pause", "ok", "ok", "pause", "ok", "ok"])  # two: a second block
    same_samples(twice, calm)
    assert ex.blocks == 2 and ex.isolated and any(t.name != "agent-loop-shared" for t in threads)
    assert "from now on each episode runs on a loop and thread of its own" in caplog.text


LINGERING_AGENT = """
import asyncio

ENDED = []


async def agent(client, example):
    async def watch():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ENDED.append(example["label"])
            raise

    asyncio.create_task(watch())  # left running when the agent returns
    await client.completions.create(model="policy", prompt=example["prompt"])
    if example["label"] == "slow":
        await asyncio.sleep(60)  # awaits: the loop runs on, this episode alone times out
    return 1.0
"""


def test_an_awaiting_agent_times_out_alone_and_the_tasks_an_agent_leaves_end_with_its_episode(sft_tok, tmp_path):
    path = tmp_path / "lingering_agent.py"
    path.write_text(LINGERING_AGENT)
    ex = OpenAIAgentExecutor(Scripted(lambda p, s: [5, 6, 2]), sft_tok, str(path), SFT, 8, 64, timeout_s=1.0)
    batch = labelled(sft_tok, ["a", "slow", "b"])
    try:
        t0 = time.monotonic()
        ro = ex.run(batch, n=1, seed=0, step=1)
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 5
        ended = ex.agent.__globals__["ENDED"]
        while len(ended) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ex.close()
    assert wall < 5.0 and not ex.isolated, wall
    assert ro.rewards.tolist() == [1.0, 0.0, 1.0] and ro.logs["rollout/agent_timeouts"] == 1
    assert sorted(ended) == ["a", "b", "slow"]  # each episode's own task, cancelled when it ended or timed out


POOL_AGENT = """
SEEN = []


async def agent(client, example):
    SEEN.append((example["label"], client._client))  # the HTTP pool the executor gave this episode
    await client.completions.create(model="policy", prompt=example["prompt"])
    if example["label"] == "close":
        await client.close()  # closes the pool too: it must not be given to the next episode
    if example["label"] == "raise":
        raise RuntimeError("a failing tool")
    return 1.0
"""


def test_an_episode_that_returned_hands_its_http_pool_to_the_next_and_a_closed_or_failed_ones_pool_is_not_kept(
    sft_tok, tmp_path
):  # fmt: skip
    path = tmp_path / "pool_agent.py"
    path.write_text(POOL_AGENT)
    ex = OpenAIAgentExecutor(Scripted(lambda p, s: [5, 6, 2]), sft_tok, str(path), SFT, 8, 64, concurrency=1)
    labels = ["a", "b", "close", "c", "raise", "d"]
    batch = labelled(sft_tok, labels)
    try:
        ro = ex.run(batch, n=1, seed=0, step=1)
    finally:
        ex.close()
    assert ro.rewards.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    seen = ex.agent.__globals__["SEEN"]
    assert [label for label, _ in seen] == labels
    pool = [http for _, http in seen]
    assert pool[0] is pool[1] is pool[2]  # kept after a, b
    assert pool[3] is not pool[2] and pool[2].is_closed  # the agent closed it: a new one for c
    assert pool[4] is pool[3]
    assert pool[5] is not pool[4] and pool[4].is_closed  # its agent raised: closed, not kept
    assert all(http.is_closed for http in pool)  # the executor closed the kept one when it closed


def test_an_agent_file_that_does_not_import_names_the_file_and_line(tmp_path):
    syntax = tmp_path / "bad_syntax.py"
    syntax.write_text("import asyncio\n\nasync def agent(client, example):\n    return 1 +\n")
    with pytest.raises(ValueError, match=r"bad_syntax\.py, line 4, column \d+: invalid syntax: 'return 1 \+'"):
        load_agent(str(syntax))
    broken = tmp_path / "bad_import.py"
    broken.write_text("import math\n\nTABLE = math.sqrt(-1)\n")
    with pytest.raises(ValueError, match=r"bad_import\.py, line 3: importing it raised ValueError: math domain error"):
        load_agent(str(broken))
