"""Agents as OpenAI API clients (agents/openai_server.py, agents/openai_agent.py), with the real `openai` client
against the real server over the embedded warm start's in-process vLLM engine: the recorded ids are the engine's,
the chat template is applied, /v1/models lists the model, a multi-call episode is masked right, episodes run
concurrently and their requests are batched, bad agents are counted without stopping the run, a batch where every
episode fails stops it, and grpo.py trains with `--rollout.agent-file` end to end."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import assert_first_step_agrees, in_process_engines, ranks_2_vs_1

from agents.openai_agent import AgentError, OpenAIAgentExecutor, load_agent
from agents.openai_server import OpenAIServer
from agents.records import Call, build_trajectory
from agents.tool_calls import render_chat
from core import embedded, models
from core.rollout import Sample

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "agents" / "examples" / "retry_agent.py"
NAME = "cleanrlhf/tiny-sft"


@pytest.fixture(scope="module")
def sft_path():
    return str(embedded.ensure_sft_warm_start())


@pytest.fixture(scope="module")
def engines(sft_path, one_thread):
    yield from in_process_engines(sft_path, "float32")


@pytest.fixture(scope="module")
def tok(sft_path):
    return models.load_tokenizer(sft_path)


@pytest.fixture
def server(engines, tok):
    s = OpenAIServer(engines, tok, NAME, max_new_tokens=8, max_context=64)
    s.start()
    yield s
    s.close()


def rows(tok, sums=((37, 5), (12, 30), (50, 49), (8, 8))) -> list[dict]:
    out = []
    for a, b in sums:
        p = f"{a:02d}+{b:02d}="
        out.append({"prompt": p, "prompt_ids": tok.encode(p), "label": f"{a + b:03d}", "datasource": "add2"})
    return out


def client_for(server: OpenAIServer, eid: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.episode_url(eid), api_key="unused", max_retries=0)


def agent_file(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return str(path)


# ------------------------------------------------------------------------------------------------- the server
def test_recorded_ids_are_the_engines_generated_ids(server, engines, tok):
    eid = server.open_episode(temperature=1.0, seed=1234)

    async def call():
        return await client_for(server, eid).completions.create(model=NAME, prompt="37+05=", max_tokens=6)

    out = asyncio.run(call())
    (c,) = server.close_episode(eid).calls
    assert c.prompt_ids == tok.encode("37+05=") and c.parent is None  # completions text: tokenized with BOS
    # the same request straight to the engine, with the first call's seed: the same sample, token for token
    (direct,) = engines.generate([c.prompt_ids], n=1, max_new_tokens=6, temperature=1.0, seed=[1234])[0]
    assert c.token_ids == direct.token_ids and c.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
    assert c.finish_reason == direct.finish_reason == out.choices[0].finish_reason
    assert out.choices[0].text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert out.choices[0].model_extra["token_ids"] == c.token_ids and out.usage.completion_tokens == len(c.token_ids)


def test_models_endpoint_lists_the_model(server):
    eid = server.open_episode(1.0, None)

    async def both():
        scoped = await client_for(server, eid).models.list()
        root = await openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).models.list()
        return scoped, root

    scoped, root = asyncio.run(both())
    assert [m.id for m in scoped.data] == [m.id for m in root.data] == [NAME]
    server.close_episode(eid)


def test_chat_requests_go_through_the_chat_template(server, tok):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "37+05="}]
    eid = server.open_episode(0.0, None)
    out = asyncio.run(client_for(server, eid).chat.completions.create(model="policy", messages=messages, logprobs=True))
    (c,) = server.close_episode(eid).calls
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: Add.\nuser: 37+05=\nassistant: "  # the embedded tokenizer's template
    assert c.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]  # the template writes its own specials
    assert out.choices[0].message.content == c.text and out.choices[0].message.role == "assistant"
    assert [t.logprob for t in out.choices[0].logprobs.content] == pytest.approx(c.logprobs)
    # a tokenizer without a chat template: the documented plain fallback
    plain = type("NoTemplate", (), {"chat_template": None})()
    assert render_chat(plain, messages) == "system: Add.\nuser: 37+05=\nassistant: "


def test_malformed_requests_are_4xx_with_a_clear_message(server):
    eid = server.open_episode(1.0, 0)
    cases = [
        (dict(model="gpt-4", prompt="1+1="), 404, "does not exist"),
        (dict(model=NAME, prompt="1+1=", n=0), 400, "number of choices"),
        (dict(model=NAME, prompt="1+1=", stop=[""]), 400, "non-empty string"),
        (dict(model=NAME, prompt="1+1=", extra_body={"tools": []}), 400, "tools are for chat completions"),
        (dict(model=NAME, prompt="1+1=", max_tokens=0), 400, "max_tokens"),
        (dict(model=NAME, prompt=""), 400, "'prompt' must be"),
        (dict(model=NAME, prompt="9" * 70), 400, "no room to generate"),
    ]

    async def refusals() -> list:
        client, out = client_for(server, eid), []
        for kw, _, _ in cases:
            try:
                await client.completions.create(**kw)
            except openai.APIStatusError as e:
                out.append(e)
        try:
            await client.chat.completions.create(model=NAME, messages=[])
        except openai.APIStatusError as e:
            out.append(e)
        return out

    errors = asyncio.run(refusals())
    assert len(errors) == len(cases) + 1
    for (kw, status, words), e in zip(cases, errors):
        assert e.status_code == status and words in str(e), (kw, e)
    assert errors[-1].status_code == 400 and "non-empty list" in str(errors[-1])
    assert server.close_episode(eid).bad_requests == len(cases) + 1
    with pytest.raises(openai.NotFoundError, match="unknown or finished episode"):
        asyncio.run(client_for(server, eid).completions.create(model=NAME, prompt="1+1="))


# --------------------------------------------------------------------------------------- multi-call trajectories
def test_a_completions_continuation_trains_on_both_answers_and_masks_the_agents_text(server, tok):
    """The example agent's second prompt is question + first answer + "\\n" + question: the first answer keeps its
    generated ids (minus the eos the text does not carry), the agent's text is masked, the second answer is trained."""
    eid = server.open_episode(1.0, 7)

    async def two_calls():
        client = client_for(server, eid)
        first = await client.completions.create(model=NAME, prompt="37+05=")
        return await client.completions.create(model=NAME, prompt="37+05=" + first.choices[0].text + "\n37+05=")

    asyncio.run(two_calls())
    c1, c2 = server.close_episode(eid).calls
    assert c2.parent == 0 and c1.token_ids[-1] == tok.eos_token_id  # the model stopped; the agent's text goes on
    first = c1.token_ids[:-1]
    agent_text = tok("\n37+05=", add_special_tokens=False)["input_ids"]
    assert c2.prompt_ids == c1.prompt_ids + first + agent_text  # the first answer is not re-tokenized
    prompt, tokens, logprobs, mask, dropped = build_trajectory([c1, c2])
    assert prompt == c1.prompt_ids and dropped == 0
    assert tokens == first + agent_text + c2.token_ids
    assert mask == [1] * len(first) + [0] * len(agent_text) + [1] * len(c2.token_ids)
    assert logprobs == c1.logprobs[:-1] + [0.0] * len(agent_text) + c2.logprobs


class ScriptedEngines:
    """Stands for the engines: answers every prompt with `reply` (log-prob −0.25 each), stopping."""

    def __init__(self, reply: list[int]):
        self.reply, self.batches = reply, []

    def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
        self.batches.append(len(prompts))
        return [[Sample(list(self.reply), [-0.25] * len(self.reply), "stop", False)] for _ in prompts]


def test_a_chat_conversation_keeps_the_models_end_of_turn_and_masks_template_and_tool_turns(tmp_path):
    """Qwen-style template: the second request's messages hold the model's answer as text; the server reuses the
    generated ids, `<|im_end|>` included (the template closes the turn with it), and masks the separator, the tool
    turn and the next assistant header. A rewritten history starts a new chain; the earlier call is dropped."""
    tok = models.load_tokenizer(str(embedded.save_tiny_chat(tmp_path / "tiny-chat")))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok("call add(1, 2)", add_special_tokens=False)["input_ids"] + [im_end]
    server = OpenAIServer(ScriptedEngines(reply), tok, "chat", max_new_tokens=16, max_context=512)
    server.start()
    try:
        eid = server.open_episode(1.0, 0)
        history = [{"role": "user", "content": "What is 1+2?"}]

        async def conversation():
            client = client_for(server, eid)
            first = await client.chat.completions.create(model="chat", messages=history)
            history.append({"role": "assistant", "content": first.choices[0].message.content})
            history.append({"role": "tool", "content": "3"})
            await client.chat.completions.create(model="chat", messages=history)
            await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Restart."}])

        asyncio.run(conversation())
        c1, c2, c3 = server.close_episode(eid).calls
    finally:
        server.close()
    assert c1.text == "call add(1, 2)" and c1.stop_text == "<|im_end|>"
    full = tok(render_chat(tok, history), add_special_tokens=False)["input_ids"]
    assert c2.parent == 0 and c2.prompt_ids == full  # here the reused ids equal tokenizing the whole conversation
    prompt, tokens, _, mask, dropped = build_trajectory([c1, c2])
    between = c2.prompt_ids[len(c1.prompt_ids) + len(reply) :]
    assert tok.decode(between).startswith("\n<|im_start|>tool") and tok.decode(between).endswith("assistant\n")
    assert tokens == reply + between + reply and mask == [1] * len(reply) + [0] * len(between) + [1] * len(reply)
    assert c3.parent is None and build_trajectory([c1, c2, c3])[4] == 2  # a new chain: the conversation was dropped
    # token-id prompts continue by ids
    tail = [5, 6]
    by_ids = Call(c1.prompt_ids + reply + tail, [9], [-0.1], "length", None)
    assert OpenAIServer._parent_by_ids(type("Log", (), {"calls": [c1]})(), by_ids.prompt_ids) == 0


# ---------------------------------------------------------------------------------------------------- executor
def test_example_agent_runs_through_the_executor(engines, tok):
    ex = OpenAIAgentExecutor(engines, tok, str(EXAMPLE), NAME, max_new_tokens=8, max_context=64)
    try:
        batch = rows(tok)
        ro = ex.run(batch, n=4, seed=11, step=0)
        again = ex.run(batch, n=4, seed=11, step=0)
    finally:
        ex.close()
    assert len(ro.episodes) == 16 and [e.example["prompt"] for e in ro.episodes[::4]] == [r["prompt"] for r in batch]
    assert set(ro.rewards.tolist()) <= {0.0, 0.5, 1.0} and ro.logs["rollout/agent_errors"] == 0
    assert 1.0 <= ro.logs["rollout/agent_calls_mean"] <= 2.0
    for e in ro.episodes:
        assert len(e.token_ids) == len(e.logprobs) == len(e.action_mask) and e.action_mask[0] == 1
        assert e.prompt_ids == e.example["prompt_ids"] and e.action_mask[-1] == 1
    # per-call seeds: the same batch and seed give the same episodes, however the requests were batched
    assert [e.token_ids for e in ro.episodes] == [e.token_ids for e in again.episodes]
    assert torch.equal(ro.rewards, again.rewards)


def test_episodes_run_concurrently_and_their_requests_are_batched(engines, tok, tmp_path):
    path = agent_file(tmp_path, "sleepy", (
        "import asyncio, threading\n"
        "running = peak = 0\n"
        "lock = threading.Lock()  # each episode runs in a thread of its own\n"
        "async def agent(client, example):\n"
        "    global running, peak\n"
        "    with lock:\n"
        "        running += 1\n"
        "        peak = max(peak, running)\n"
        "    await asyncio.sleep(0.5)\n"
        "    await client.completions.create(model='policy', prompt=example['prompt'])\n"
        "    with lock:\n"
        "        running -= 1\n"
        "    return 1.0\n"
    ))  # fmt: skip
    ex = OpenAIAgentExecutor(engines, tok, path, NAME, 8, 64, concurrency=8)
    sizes = []
    original = engines.generate

    def spy(prompts, **kw):
        sizes.append(len(prompts))
        return original(prompts, **kw)

    engines.generate = spy
    try:
        t0 = time.perf_counter()
        ro = ex.run(rows(tok), n=4, seed=0, step=0)  # 16 episodes, 8 at a time, 0.5 s of sleep each
        wall = time.perf_counter() - t0
    finally:
        del engines.generate
        ex.close()
    assert ro.rewards.tolist() == [1.0] * 16
    assert ex.agent.__globals__["peak"] == 8  # bounded by --rollout.agent-concurrency, and reached
    assert wall < 16 * 0.5 / 2, wall  # sequential would take 8 s of sleeping alone
    assert max(sizes) > 1 and sum(sizes) == 16, sizes  # concurrent requests share engine calls


BAD_AGENT = """
import asyncio, math

async def agent(client, example):
    kind = example["label"]
    if kind == "raise":
        raise KeyError("no such tool")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "malformed":
        await client.completions.create(model="policy", prompt=example["prompt"], n=0)
    if kind == "nan":
        await client.completions.create(model="policy", prompt=example["prompt"])
        return math.nan
    if kind == "silent":
        return 1.0
    await client.completions.create(model="policy", prompt=example["prompt"])
    return 1.0
"""


def test_bad_agents_fail_their_episode_with_a_reason_and_the_run_goes_on(engines, tok, tmp_path, caplog):
    path = agent_file(tmp_path, "bad_agent", BAD_AGENT)
    ex = OpenAIAgentExecutor(engines, tok, path, NAME, 8, 64, timeout_s=1.0)
    kinds = ["ok", "raise", "hang", "malformed", "nan", "silent"]
    batch = [{"prompt": "37+05=", "prompt_ids": tok.encode("37+05="), "label": k} for k in kinds]
    try:
        with caplog.at_level(logging.WARNING, logger="agents.openai_agent"):
            ro = ex.run(batch, n=2, seed=0, step=3)
    finally:
        ex.close()
    reasons = [e.finish_reason for e in ro.episodes[::2]]
    assert reasons[0] in ("stop", "length")
    assert reasons[1:] == ["agent_raised", "agent_timeout", "agent_bad_request", "agent_bad_reward", "agent_no_calls"]
    assert ro.rewards.tolist() == [1.0, 1.0] + [0.0] * 10
    for e in ro.episodes[2:]:  # failed: one masked token, nothing trained on
        assert e.action_mask == [0] and e.prompt_ids == e.example["prompt_ids"]
    assert ro.logs["rollout/agent_errors"] == 10 and ro.logs["rollout/agent_timeouts"] == 2
    assert ro.logs["rollout/agent_bad_requests"] == 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert "bad_agent.py: 10 of 12 episodes of step 3 failed" in line and "KeyError" in line and "timeout 2" in line


def test_a_batch_where_every_episode_fails_stops_naming_the_file_and_the_first_error(engines, tok, tmp_path):
    path = agent_file(tmp_path, "broken_agent", "async def agent(client, example):\n    raise ValueError('boom')\n")
    ex = OpenAIAgentExecutor(engines, tok, path, NAME, 8, 64)
    try:
        with pytest.raises(AgentError, match=r"broken_agent\.py: all 8 episodes of step 5 failed.*ValueError: boom"):
            ex.run(rows(tok), n=2, seed=0, step=5)
        with pytest.raises(AgentError, match="of the eval failed"):
            ex.run(rows(tok), n=1, seed=None, step=-1, temperature=0.0)
    finally:
        ex.close()


def test_agent_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_agent(str(tmp_path / "nope.py"))
    with pytest.raises(AttributeError, match=r"sync_agent\.py.*async def agent"):
        load_agent(agent_file(tmp_path, "sync_agent", "def agent(client, example):\n    return 1.0\n"))


# ------------------------------------------------------------------------------------------------ the scripts
@pytest.mark.parametrize("script", ["grpo", "rloo", "reinforce_pp", "ppo", "grpo_async"])
def test_every_rl_script_takes_the_agent_flags(script):
    import importlib

    import tyro

    mod = importlib.import_module(f"algos.{script}")
    args = tyro.cli(mod.Args, args=["--rollout.agent-file", str(EXAMPLE), "--rollout.agent-concurrency", "8",
                                    "--rollout.agent-timeout-s", "30"])  # fmt: skip
    assert (args.rollout.agent_file, args.rollout.agent_concurrency, args.rollout.agent_timeout_s) == (
        str(EXAMPLE), 8, 30.0)  # fmt: skip


def test_env_file_and_agent_file_together_are_refused():
    from algos.grpo import Args, main

    args = Args()
    args.rollout.env_file, args.rollout.agent_file = "agents/retry_env.py", str(EXAMPLE)
    with pytest.raises(ValueError, match="--rollout.env-file.*--rollout.agent-file.*give one"):
        main(args)  # before anything loads


@pytest.mark.slow
def test_grpo_trains_through_the_example_agent(tmp_path, one_thread):
    """`algos/grpo.py --rollout.agent-file agents/examples/retry_agent.py`: rewards in {0, 0.5, 1}, two-call episodes,
    the agent metrics logged, a finite loss, and the engine's log-probs equal to the trainer's after every sync."""
    from agents import openai_agent
    from algos.grpo import Args, main

    seen = []
    original = openai_agent.OpenAIAgentExecutor.run

    def spy(self, *a, **k):
        ro = original(self, *a, **k)
        seen.append(ro)
        return ro

    args = Args()
    args.rollout.agent_file = str(EXAMPLE)
    args.train.max_steps, args.rollout.batch_size, args.train.micro_batch_size = 2, 16, 64
    args.eval.every, args.eval.max_samples, args.eval.k = 2, 32, 2
    args.logger.quiet, args.logger.tensorboard, args.debug = True, False, True
    args.run_dir = str(tmp_path / "run")
    openai_agent.OpenAIAgentExecutor.run = spy
    try:
        summary = main(args)
    finally:
        openai_agent.OpenAIAgentExecutor.run = original
    train = [ro for ro in seen if len(ro.episodes) == 16 * args.rollout.n_samples]
    assert len(train) == 2
    rewards = torch.cat([ro.rewards for ro in train])
    assert set(rewards.tolist()) <= {0.0, 0.5, 1.0} and (rewards == 1.0).any()
    assert any(0 in e.action_mask for ro in train for e in ro.episodes), "no two-call episode"
    metrics = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    last = metrics[-1]
    assert last["rollout/agent_errors"] == 0 and 1.0 < last["rollout/agent_calls_mean"] <= 2.0
    assert math.isfinite(last["loss/policy"]) and "eval/pass@1" in last


@pytest.mark.slow
def test_agent_file_with_two_ray_ranks_trains_like_one_process(tmp_path):
    """`--rollout.agent-file` with `--train.ranks 2`: each trainer rank serves its share of the episodes through a
    server of its own over the shared vLLM engine actor (`--debug` after every sync); the first step sees the same
    episodes and rewards as one process and gives the same losses, gradient norm and KL."""
    from algos.grpo import Args, main

    def agent(args, ranks):
        args.rollout.agent_file = str(EXAMPLE)
        args.algo.kl_coef, args.ref.name_or_path = 0.05, "cleanrlhf/tiny"
        args.ref.zero_stage = 3 if ranks == 2 else 0

    rows = ranks_2_vs_1(Args, main, tmp_path, agent)
    assert_first_step_agrees(rows, extra_keys=("rollout/agent_calls_mean",))
    assert all(r["rollout/agent_errors"] == 0 for r in rows[2] + rows[1])
