"""The embedded arithmetic task as an OpenAI Agents SDK agent (pip package `openai-agents`, module `agents`),
unchanged SDK code pointed at the episode's server:

    pip install --no-deps --target .venv/openai-agents-sdk "openai-agents==0.24.0"    # apart: see docs/agents.md
    PYTHONPATH=.venv/openai-agents-sdk python algos/grpo.py \
        --rollout.agent-file agents/examples/openai_agents_sdk_agent.py

The SDK's import name `agents` is this repo's package name too. It works when the SDK's `agents` comes first on
`sys.path` (so not with the repo root first: no `python -m` or `python -c` from the repo root) and the repo's modules
(`agents.executor`, `agents.openai_agent`, ...) are found by the editable install's finder, as no SDK module has their
names; docs/agents.md says how and why.

`OpenAIChatCompletionsModel` speaks chat completions to any OpenAI-compatible server; it gets a client on the
episode's base URL and the model name the server lists. One `Runner.run` asks `37+05=` (a right answer earns 1.0); a
wrong one is answered "Wrong, try again." in the same conversation (`result.to_input_list()` + the new user turn,
the SDK's way to continue) and a right second answer earns 0.5. Tracing is off: it would upload to OpenAI.
"""

from __future__ import annotations

from openai import AsyncOpenAI

# the OpenAI Agents SDK, not this repo's package (see above); ruff counts it as first-party by its name
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from rewards.arithmetic import score

set_tracing_disabled(True)


async def agent(client, example: dict) -> float:
    name = (await client.models.list()).data[0].id
    # the SDK's own client on the episode's URL; max_retries=0: a retry would be a second generation of the turn;
    # closed when the episode ends (`async with`; see agents/examples/pydantic_ai_agent.py)
    async with AsyncOpenAI(base_url=str(client.base_url), api_key="cleanrlhf", max_retries=0) as episode:
        adder = Agent(name="adder", model=OpenAIChatCompletionsModel(model=name, openai_client=episode))
        first = await Runner.run(adder, example["prompt"], max_turns=1)
        if score(str(first.final_output), example["label"]) > 0:
            return 1.0
        retry = first.to_input_list() + [{"role": "user", "content": "Wrong, try again."}]
        second = await Runner.run(adder, retry, max_turns=1)
        return 0.5 * score(str(second.final_output), example["label"])
