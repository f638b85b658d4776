"""Agent throughput: episodes through the OpenAI-compatible server, concurrent against one at a time, and the server's
cost per call against the engine called directly, on one in-process vLLM engine, side by side in one run.

    .venv/bin/python tests/benchmarks/bench_agents.py                                  # N = 1 4 16 64, 5 repeats
    .venv/bin/python tests/benchmarks/bench_agents.py --episodes 8 --concurrency 1 4 --repeats 1   # a smoke run
    .venv/bin/python tests/benchmarks/bench_agents.py --model M --dtype bfloat16 --max-new-tokens 32 ...   # a larger model
    .venv/bin/python tests/benchmarks/bench_agents.py --parts tools --episodes 128 --concurrency 1 16 --repeats 3  # (d) alone

The model is the embedded warm start `cleanrlhf/tiny-sft` (built on first use), fp32, in an in-process engine
(`core.rollout.create_engines`, as the tests make it); the prompts are the first `--episodes` training sums of the
embedded task (`37+05=`), one episode each; sampling as the RL scripts roll out: temperature 1, top-p 1, at most
`--max-new-tokens` (8) tokens per call, episode i seeded `--seed` + i. Everything runs in this process.

(a) Episodes/s. The example agent `agents/examples/retry_agent.py` (one completions call; a second when the first
answer is wrong) through `OpenAIAgentExecutor`: the real server, the real `openai` client, an httpx pool per
episode, the trajectories built. `executor.run` over all the episodes with `--rollout.agent-concurrency` N, for each
N of `--concurrency`; N = 1 is the sequential executor (one episode at a time, each call an engine call of one
prompt). The speed-up at N is episodes/s at N over episodes/s at N = 1. Per-call seeds make every N generate the same
episodes, the same calls and the same tokens (checked), so the work is equal and only the batching differs.

(b) Server overhead per call. A one-call agent (one completions request for the row's prompt, nothing else) through
the same executor at concurrency B, against the engine called directly (`engines.generate`, what the single-turn
executor does) on the same prompt ids in consecutive calls of B prompts each, with the same seeds, max tokens and
sampling: both sides generate exactly the same tokens (checked). For each B of `--concurrency`:

    overhead(B) = t_server(B) / t_direct(B) - 1,      ms/call(B) = (t_server(B) - t_direct(B)) / episodes

where t is the wall time of all `--episodes` calls (executor.run from call to return: opening the episodes, their
clients, HTTP, tokenizing the text prompt, batching, the engine, decoding, JSON both ways, the client's parsing, the
trajectories; direct: the engine calls alone). CPU time of this process per call is reported too (less sensitive to
other jobs on the machine: the engine runs in this process, so both sides' CPU is all theirs); so are (a)'s
speed-ups, as the ratio of the CPU seconds of the runs (on a busy machine the wall times move by 2-3x, the CPU
seconds by ~30 %).

(c) The client's floor. The same one-call agent code path on the agent's side (an `openai.AsyncOpenAI` client per
episode over an httpx pool of its own, kept for the next episode once it returned, as the executor does; one
completions request, the answer parsed) against a stand-in server in a
separate process that answers every request at once with a fixed completion (no engine, no tokenizer, no FastAPI),
at concurrency B. Its time per call is what the agent side alone costs: a lower bound on the overhead of any server
the agents reach through the official `openai` client from the trainer's process, whatever the server does:

    floor(B) = t_client(B) / t_direct(B)        (overhead(B) >= floor(B) for every server)

(d) Tools and streaming (`--parts tools`; `--parts abc` runs (a)-(c) alone). The example agent
`agents/examples/calculator_tools_agent.py`: chat completions with a calculator in `tools` and `stream=True` through
the `openai` client, a second streamed turn after a tool call, on `cleanrlhf/tiny-chat` (the embedded chat model, its
Qwen-style template; a random ~0.1 M model in its own in-process engine, fp32), the same rows as the user message.
tiny-chat's template ignores `tools`, so the server writes them in the Hermes layout into a system turn: the first
prompt is ~490 tokens where the bare question is ~26. The random model practically never writes a well-formed
`<tool_call>`, so nearly every episode is one streamed call (the JSON line counts the calls and tool calls): what this
times is the server's path with tools rendered and the answer sent as server-sent events, not a tool loop. As (a):
episodes/s at each N by wall time and by CPU seconds, and the speed-up at N over the first N by both (every N
generates the same episodes: checked). Beside it, to tell apart what costs what, one chat call per episode with
neither feature (`plain`), `stream` alone and `tools` alone through the same executor, and `engines.generate` direct
on the agent's first prompts (tools rendered) in calls of N prompts.

Timing: one warm-up of every side, then `--repeats` rounds, each round timing every side once in turn (so load from
other jobs spreads over all of them); each number is the median of its repeats (the best is in the JSON line). Prints
a summary and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "agents" / "examples" / "retry_agent.py"
TOOLS_AGENT = ROOT / "agents" / "examples" / "calculator_tools_agent.py"
ONE_CALL_AGENT = '''"""One completions call per episode: the server's cost per call, nothing else."""


async def agent(client, example):
    out = await client.completions.create(model="policy", prompt=example["prompt"])
    return float(bool(out.choices[0].text))
'''
ONE_CHAT_AGENT = '''"""One chat call per episode, tools TOOLS, stream STREAM: (d)'s agent with one of its features off."""
import json

CALCULATOR = json.loads(CALCULATOR_JSON)


async def agent(client, example):
    extra = {"tools": [CALCULATOR]} if TOOLS else {}
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["prompt"]}],
                                               stream=STREAM, **extra)
    if STREAM:
        return float(bool("".join([c.choices[0].delta.content or "" async for c in out if c.choices])))
    return float(bool(out.choices[0].message.content))
'''

CANNED_SERVER = r'''
import asyncio, json, sys

BODY = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "policy",
                   "choices": [{"index": 0, "text": "12", "finish_reason": "stop", "logprobs": None}],
                   "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}).encode()
KIND = b"application/json"
if len(sys.argv) > 1:  # another answer, e.g. a streamed chat answer: its body on stdin, its content type in argv
    BODY, KIND = sys.stdin.buffer.read(), sys.argv[1].encode()
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: " + KIND + b"\r\ncontent-length: " + str(len(BODY)).encode()
        + b"\r\n\r\n")


async def serve(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(HEAD + BODY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''


def client_floor(port: int, prompts: list[str], concurrency: int) -> list[str]:
    """The agent side of one completions call per prompt (as OpenAIAgentExecutor runs a one-call agent, see
    `agent_floor`), against the canned server on `port`: the texts it got back."""

    async def one_completion(client, row):
        out = await client.completions.create(model="policy", prompt=row["prompt"])
        return out.choices[0].text

    return agent_floor(port, one_completion, [{"prompt": p} for p in prompts], concurrency)


def streamed_chat_answer(prompt_ids: list[int], token_ids: list[int], text: str) -> bytes:
    """A streamed chat answer of one call as this project's server sends it (role chunk with the prompt's ids,
    content chunk with the tokens' ids, final chunk, `[DONE]`), with no tool call: what the canned server replays."""
    head = {"id": "chatcmpl-0", "created": 0, "object": "chat.completion.chunk", "model": "policy"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], "prompt_token_ids": prompt_ids},
        {**head, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
                              "token_ids": token_ids}]},
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "token_ids": []}]},
    ]  # fmt: skip
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


def agent_floor(port: int, agent, rows: list[dict], concurrency: int) -> list:
    """The agent side alone: `agent(client, row)` for each row (an AsyncOpenAI client per episode over an httpx pool
    of its own while it runs, a returned episode's pool kept for the next one, as OpenAIAgentExecutor gives them)
    against the canned server on `port`; the rewards it returned."""
    import asyncio
    import ssl

    import httpx
    import openai

    context = ssl.create_default_context()

    async def episode(gate, row, kept):
        async with gate:
            http = kept.pop() if kept else httpx.AsyncClient(timeout=60, trust_env=False, verify=context)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", http_client=http,
                                        max_retries=0)  # fmt: skip
            value = await agent(client, row)
            kept.append(http)
            return value

    async def run_all():
        gate, kept = asyncio.Semaphore(concurrency), []
        try:
            return await asyncio.gather(*[episode(gate, r, kept) for r in rows])
        finally:
            for http in kept:
                await http.aclose()

    return asyncio.run(run_all())


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def server_parts(opts) -> dict:
    """(a), (b) and (c) on the embedded warm start: their numbers, the summary printed."""
    import subprocess
    import sys

    import torch

    from agents.openai_agent import OpenAIAgentExecutor
    from core import embedded, models, rollout

    torch.set_num_threads(opts.threads)
    path = opts.model or str(embedded.ensure_sft_warm_start())
    tokenizer = models.load_tokenizer(path)
    train, _ = embedded.task_rows(2)
    rows = [{"prompt": r["prompt"], "prompt_ids": tokenizer(r["prompt"])["input_ids"], "label": r["answer"],
             "datasource": r["datasource"]} for r in train[: opts.episodes]]  # fmt: skip
    t0 = time.perf_counter()
    cfg = rollout.VLLMConfig(in_process=True, dtype=opts.dtype, kv_cache_gib=0.5, timeout_s=300)
    engines = rollout.create_engines(path, cfg, seed=0)
    start_s = time.perf_counter() - t0
    max_context = models.max_positions(path, "model")
    T, E, S = opts.max_new_tokens, len(rows), opts.seed
    one_call = Path(tempfile.mkdtemp(prefix="bench_agents_")) / "one_call_agent.py"
    one_call.write_text(ONE_CALL_AGENT)
    example = OpenAIAgentExecutor(engines, tokenizer, str(EXAMPLE), "cleanrlhf/tiny-sft", T, max_context)
    single = OpenAIAgentExecutor(engines, tokenizer, str(one_call), "cleanrlhf/tiny-sft", T, max_context)

    def run_agents(executor, n: int):
        executor.concurrency = n
        return executor.run(rows, n=1, seed=S, step=0)

    def direct(b: int):
        ids = [r["prompt_ids"] for r in rows]
        out = []
        for k in range(0, E, b):
            out += engines.generate(ids[k : k + b], n=1, max_new_tokens=T, temperature=1.0, seed=S + k)
        return out

    canned = subprocess.Popen([sys.executable, "-c", CANNED_SERVER], stdout=subprocess.PIPE, text=True)
    port = int(canned.stdout.readline())
    sides = {}
    for n in opts.concurrency:
        sides[f"agent@{n}"] = lambda n=n: run_agents(example, n)
    for b in opts.concurrency:
        sides[f"server@{b}"] = lambda b=b: run_agents(single, b)
        sides[f"direct@{b}"] = lambda b=b: direct(b)
        sides[f"client@{b}"] = lambda b=b: client_floor(port, [r["prompt"] for r in rows], b)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    try:
        outputs = {k: fn() for k, fn in sides.items()}  # warm-up, and the outputs the checks below compare
        for _ in range(opts.repeats):
            for k, fn in sides.items():
                wall, cpu, _ = timed(fn)
                times[k].append((wall, cpu))
    finally:
        example.close()
        single.close()
        engines.shutdown()
        canned.kill()

    # the same work on every side: the same episodes at every N, the server's tokens are the engine's
    first = outputs[f"agent@{opts.concurrency[0]}"]
    for n in opts.concurrency:
        ro = outputs[f"agent@{n}"]
        assert [e.token_ids for e in ro.episodes] == [e.token_ids for e in first.episodes], f"N={n}: other episodes"
        assert ro.logs["rollout/agent_errors"] == 0, ro.logs
    for b in opts.concurrency:
        ro, groups = outputs[f"server@{b}"], outputs[f"direct@{b}"]
        assert ro.logs["rollout/agent_errors"] == 0, ro.logs
        assert [e.token_ids for e in ro.episodes] == [g[0].token_ids for g in groups], f"B={b}: other tokens"
        assert outputs[f"client@{b}"] == ["12"] * E, f"B={b}: the canned server's answers did not come back"

    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    best = {k: min(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    calls = round(first.logs["rollout/agent_calls_mean"] * E)
    n0 = opts.concurrency[0]
    throughput = {
        n: {"episodes_per_s": E / med[f"agent@{n}"], "speedup": med[f"agent@{n0}"] / med[f"agent@{n}"],
            "speedup_best": best[f"agent@{n0}"] / best[f"agent@{n}"],
            "speedup_cpu": cpu[f"agent@{n0}"] / cpu[f"agent@{n}"],
            "ms_per_call": 1000 * med[f"agent@{n}"] / calls}
        for n in opts.concurrency
    }  # fmt: skip
    overhead = {
        b: {"server_ms_per_call": 1000 * med[f"server@{b}"] / E, "direct_ms_per_call": 1000 * med[f"direct@{b}"] / E,
            "overhead": med[f"server@{b}"] / med[f"direct@{b}"] - 1,
            "overhead_best": best[f"server@{b}"] / best[f"direct@{b}"] - 1,
            "overhead_cpu": cpu[f"server@{b}"] / cpu[f"direct@{b}"] - 1,
            "extra_ms_per_call": 1000 * (med[f"server@{b}"] - med[f"direct@{b}"]) / E,
            "extra_cpu_ms_per_call": 1000 * (cpu[f"server@{b}"] - cpu[f"direct@{b}"]) / E,
            "client_ms_per_call": 1000 * med[f"client@{b}"] / E, "client_cpu_ms_per_call": 1000 * cpu[f"client@{b}"] / E,
            "floor": med[f"client@{b}"] / med[f"direct@{b}"], "floor_cpu": cpu[f"client@{b}"] / cpu[f"direct@{b}"]}
        for b in opts.concurrency
    }  # fmt: skip
    result = {
        "episodes": E, "calls_example_agent": calls, "max_new_tokens": T, "repeats": opts.repeats,
        "threads": opts.threads, "engine_start_s": round(start_s, 1), "throughput": throughput, "overhead": overhead,
        "wall_s": {k: [round(w, 4) for w, _ in v] for k, v in times.items()},
        "cpu_s": {k: [round(c, 4) for _, c in v] for k, v in times.items()},
    }  # fmt: skip
    print(f"{opts.model or 'embedded warm start'}, in-process vLLM engine ({opts.dtype}, {opts.threads} torch "
          f"thread(s), started in {start_s:.1f} s); {E} episodes per run, at most {T} tokens per call; medians of {opts.repeats} "
          "repeats")  # fmt: skip
    print(f"(a) example agent (retry_agent.py, {calls} calls = {calls / E:.2f} per episode) through the server:")
    for n, r in throughput.items():
        print(f"    concurrency {n:>3}: {r['episodes_per_s']:7.1f} episodes/s, {r['ms_per_call']:6.2f} ms/call, "
              f"{r['speedup']:5.2f}x the sequential executor (best-of {r['speedup_best']:.2f}x, CPU time "
              f"{r['speedup_cpu']:.2f}x)")  # fmt: skip
    print("(b) one-call agent through server + openai client vs engines.generate direct, same prompts/seeds/tokens:")
    for b, r in overhead.items():
        print(f"    batch {b:>3}: server {r['server_ms_per_call']:6.2f} ms/call, direct {r['direct_ms_per_call']:6.2f}"
              f" ms/call: overhead {100 * r['overhead']:+6.1f} % (best-of {100 * r['overhead_best']:+.1f} %, CPU time "
              f"{100 * r['overhead_cpu']:+.1f} %), +{r['extra_ms_per_call']:.2f} ms wall, "
              f"+{r['extra_cpu_ms_per_call']:.2f} ms CPU per call")  # fmt: skip
    print("(c) the agent side alone (openai client per episode, one call) against a canned server in another process:")
    for b, r in overhead.items():
        print(f"    batch {b:>3}: {r['client_ms_per_call']:6.2f} ms/call wall, {r['client_cpu_ms_per_call']:6.2f} ms CPU "
              f"= floor {100 * r['floor']:+6.1f} % of direct (CPU time {100 * r['floor_cpu']:+.1f} %): no server "
              f"reached through the openai client from this process costs less")  # fmt: skip
    return result


def tools_part(opts) -> dict:
    """(d) on `cleanrlhf/tiny-chat`: episodes/s of the tools-and-streaming agent at each N, the plain chat call and
    the engine direct beside it; the summary printed."""
    import subprocess
    import sys

    import torch

    from agents.openai_agent import OpenAIAgentExecutor
    from core import embedded, models, rollout

    torch.set_num_threads(opts.threads)
    path = str(embedded.ensure_tiny_chat())
    tokenizer = models.load_tokenizer(path)
    train, _ = embedded.task_rows(2)
    rows = [{"prompt": r["prompt"], "prompt_ids": tokenizer(r["prompt"])["input_ids"], "label": r["answer"],
             "datasource": r["datasource"]} for r in train[: opts.episodes]]  # fmt: skip
    t0 = time.perf_counter()
    cfg = rollout.VLLMConfig(in_process=True, dtype=opts.dtype, kv_cache_gib=0.5, timeout_s=300)
    engines = rollout.create_engines(path, cfg, seed=0)
    start_s = time.perf_counter() - t0
    T, E, S = opts.max_new_tokens, len(rows), opts.seed
    max_context = models.max_positions(path, "model")
    folder = Path(tempfile.mkdtemp(prefix="bench_agents_"))
    calculator = json.dumps(runpy.run_path(str(TOOLS_AGENT))["CALCULATOR"])  # the same tool schema as the agent's
    executors = {"tools": OpenAIAgentExecutor(engines, tokenizer, str(TOOLS_AGENT), "cleanrlhf/tiny-chat", T,
                                              max_context)}  # fmt: skip
    for kind, use_tools, stream in (("plain", False, False), ("stream", False, True), ("tools_only", True, False)):
        file = folder / f"{kind}_chat_agent.py"
        file.write_text(ONE_CHAT_AGENT.replace("TOOLS", str(use_tools)).replace("STREAM", str(stream))
                        .replace("CALCULATOR_JSON", repr(calculator)))  # fmt: skip
        executors[kind] = OpenAIAgentExecutor(engines, tokenizer, str(file), "cleanrlhf/tiny-chat", T, max_context)

    def run_agents(executor, n: int):
        executor.concurrency = n
        return executor.run(rows, n=1, seed=S, step=0)

    first_prompts: list[list[int]] = []  # the first call's prompt ids (tools rendered), from the warm-up

    def direct(b: int):
        out = []
        for k in range(0, E, b):
            out += engines.generate(first_prompts[k : k + b], n=1, max_new_tokens=T, temperature=1.0, seed=S + k)
        return out

    sides = {}
    for n in opts.concurrency:
        for kind, executor in executors.items():
            sides[f"{kind}@{n}"] = lambda n=n, executor=executor: run_agents(executor, n)
        sides[f"direct@{n}"] = lambda n=n: direct(n)
    outputs, canned = {}, None
    try:
        for k, fn in list(sides.items()):  # warm-up, and the outputs the checks below compare
            outputs[k] = fn()
            if k.startswith("tools@") and not first_prompts:
                first_prompts += [e.prompt_ids for e in outputs[k].episodes]
        # the agent side alone: the same agent against a canned server replaying a streamed answer of this size
        sample = outputs[f"tools@{opts.concurrency[0]}"].episodes[0]
        body = streamed_chat_answer(first_prompts[0], sample.token_ids[-T:], "12")
        canned = subprocess.Popen([sys.executable, "-c", CANNED_SERVER, "text/event-stream"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)  # fmt: skip
        canned.stdin.write(body)
        canned.stdin.close()
        port = int(canned.stdout.readline())
        agent_fn = runpy.run_path(str(TOOLS_AGENT))["agent"]
        for n in opts.concurrency:
            sides[f"floor@{n}"] = lambda n=n: agent_floor(port, agent_fn, rows, n)
            outputs[f"floor@{n}"] = sides[f"floor@{n}"]()
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        for _ in range(opts.repeats):
            for k, fn in sides.items():
                wall, cpu, _ = timed(fn)
                times[k].append((wall, cpu))
    finally:
        for executor in executors.values():
            executor.close()
        engines.shutdown()
        if canned is not None:
            canned.kill()

    # the same episodes at every N; the tools were in the prompt (the Hermes layout: tiny-chat's template ignores them)
    n0 = opts.concurrency[0]
    first = outputs[f"tools@{n0}"]
    assert "<tools>" in tokenizer.decode(first.episodes[0].prompt_ids), "the tools were not rendered into the prompt"
    for n in opts.concurrency:
        for kind in executors:
            ro = outputs[f"{kind}@{n}"]
            assert ro.logs["rollout/agent_errors"] == 0, (kind, n, ro.logs)
            ref = outputs[f"{kind}@{n0}"]
            same = [e.token_ids for e in ro.episodes] == [e.token_ids for e in ref.episodes]
            assert same, f"{kind} N={n}: other episodes"
        assert len(outputs[f"floor@{n}"]) == E, f"N={n}: the canned server's answers did not all come back"

    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    best = {k: min(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    calls = round(first.logs["rollout/agent_calls_mean"] * E)
    prompt_tokens = statistics.mean(len(p) for p in first_prompts)
    plain_prompt_tokens = statistics.mean(len(e.prompt_ids) for e in outputs[f"plain@{n0}"].episodes)
    throughput = {
        n: {"episodes_per_s": E / med[f"tools@{n}"], "episodes_per_cpu_s": E / cpu[f"tools@{n}"],
            "speedup": med[f"tools@{n0}"] / med[f"tools@{n}"], "speedup_best": best[f"tools@{n0}"] / best[f"tools@{n}"],
            "speedup_cpu": cpu[f"tools@{n0}"] / cpu[f"tools@{n}"],
            "ms_per_call": 1000 * med[f"tools@{n}"] / calls, "cpu_ms_per_call": 1000 * cpu[f"tools@{n}"] / calls,
            **{f"{kind}_{key}": value for kind in ("plain", "stream", "tools_only") for key, value in (
                ("episodes_per_s", E / med[f"{kind}@{n}"]), ("ms_per_call", 1000 * med[f"{kind}@{n}"] / E),
                ("cpu_ms_per_call", 1000 * cpu[f"{kind}@{n}"] / E),
                ("speedup", med[f"{kind}@{n0}"] / med[f"{kind}@{n}"]),
                ("speedup_cpu", cpu[f"{kind}@{n0}"] / cpu[f"{kind}@{n}"]))},
            "direct_ms_per_call": 1000 * med[f"direct@{n}"] / E, "direct_cpu_ms_per_call": 1000 * cpu[f"direct@{n}"] / E,
            "floor_ms_per_call": 1000 * med[f"floor@{n}"] / E, "floor_cpu_ms_per_call": 1000 * cpu[f"floor@{n}"] / E,
            # a server costing nothing at every N: the agent side alone plus the engine's batched calls
            "bound": (med[f"floor@{n0}"] + med[f"direct@{n0}"]) / (med[f"floor@{n}"] + med[f"direct@{n}"]),
            "bound_cpu": (cpu[f"floor@{n0}"] + cpu[f"direct@{n0}"]) / (cpu[f"floor@{n}"] + cpu[f"direct@{n}"])}
        for n in opts.concurrency
    }  # fmt: skip
    result = {
        "episodes": E, "calls": calls, "tool_calls_mean": first.logs["rollout/agent_tool_calls_mean"],
        "tool_parse_errors_mean": first.logs["rollout/tool_parse_errors_mean"], "prompt_tokens_mean": prompt_tokens,
        "plain_prompt_tokens_mean": plain_prompt_tokens, "engine_start_s": round(start_s, 1), "throughput": throughput,
        "wall_s": {k: [round(w, 4) for w, _ in v] for k, v in times.items()},
        "cpu_s": {k: [round(c, 4) for _, c in v] for k, v in times.items()},
    }  # fmt: skip
    print(f"(d) cleanrlhf/tiny-chat, in-process vLLM engine ({opts.dtype}, started in {start_s:.1f} s): the tools agent "
          f"(calculator_tools_agent.py: `tools` + stream=True, {calls} calls = {calls / E:.2f} per episode, "
          f"{result['tool_calls_mean']:.3f} tool calls per episode, prompts of {prompt_tokens:.0f} tokens with the tools "
          f"rendered, {plain_prompt_tokens:.0f} without):")  # fmt: skip
    for n, r in throughput.items():
        print(f"    concurrency {n:>3}: {r['episodes_per_s']:7.1f} episodes/s ({r['episodes_per_cpu_s']:.1f} per CPU s), "
              f"{r['ms_per_call']:6.2f} ms/call ({r['cpu_ms_per_call']:.2f} CPU), {r['speedup']:5.2f}x the sequential "
              f"executor (best-of {r['speedup_best']:.2f}x, CPU time {r['speedup_cpu']:.2f}x)")  # fmt: skip
    print("    one chat call per episode, ms/call wall / CPU (speed-up at N over N = 1, wall / CPU):")
    for n, r in throughput.items():
        cells = [f"{name} {r[f'{kind}_ms_per_call']:.2f} / {r[f'{kind}_cpu_ms_per_call']:.2f} "
                 f"({r[f'{kind}_speedup']:.2f}x / {r[f'{kind}_speedup_cpu']:.2f}x)"
                 for kind, name in (("plain", "plain"), ("stream", "stream"), ("tools_only", "tools"))]  # fmt: skip
        print(f"    concurrency {n:>3}: {', '.join(cells)}; both (the agent) {r['ms_per_call']:.2f} / "
              f"{r['cpu_ms_per_call']:.2f}; engine direct on the tools prompts {r['direct_ms_per_call']:.2f} / "
              f"{r['direct_cpu_ms_per_call']:.2f}")  # fmt: skip
    print("    the agent side alone against a canned server in another process replaying a streamed answer (its floor), "
          "ms/call wall / CPU, and the speed-up a server costing nothing at every N would give, (floor + engine direct) "
          "at the first N over the same at N, wall / CPU:")  # fmt: skip
    for n, r in throughput.items():
        print(f"    concurrency {n:>3}: floor {r['floor_ms_per_call']:.2f} / {r['floor_cpu_ms_per_call']:.2f}, "
              f"zero-cost server {r['bound']:.2f}x / {r['bound_cpu']:.2f}x")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=128, help="episodes per timed run (one per prompt)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="N (a) and B (b)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the 2-core box is shared)")
    ap.add_argument("--model", default=None, help="an HF folder with the embedded tokenizer instead of the warm start")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (bfloat16 for a large --model)")
    ap.add_argument("--parts", nargs="+", choices=["abc", "tools"], default=["abc", "tools"],
                    help="abc: (a)-(c) on the warm start; tools: (d) on tiny-chat")  # fmt: skip
    opts = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = server_parts(opts) if "abc" in opts.parts else {}
    if "tools" in opts.parts:
        result["tools"] = tools_part(opts)
    print(json.dumps({"bench": "agents", **result}))
    return result


if __name__ == "__main__":  # vLLM may spawn processes; nothing may run at import
    main()
