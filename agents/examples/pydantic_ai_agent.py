"""The embedded arithmetic task as a pydantic-ai agent, unchanged pydantic-ai code pointed at the episode's server:

    pip install -e ".[frameworks]"
    python algos/grpo.py --rollout.agent-file agents/examples/pydantic_ai_agent.py

pydantic-ai's `OpenAIChatModel` talks to any OpenAI-compatible server; here its provider gets the episode's base URL
(`client.base_url`, which tags every request with the episode) and the model name the server lists. The agent asks
`37+05=` as a user message; a right answer earns 1.0. A wrong one is answered "Wrong, try again." in the same
conversation (`message_history`: the model's first answer goes back as the assistant turn, so the server reuses its
sampled tokens) and a right second answer earns 0.5. Both answers are trained on; the template and the agent's text
are masked. tests/test_frameworks.py runs it through the executor and grpo.py.
"""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from rewards.arithmetic import score


async def agent(client, example: dict) -> float:
    name = (await client.models.list()).data[0].id
    # The provider's own client on the episode's URL; max_retries=0: a retry would be a second generation of the turn.
    # Closed when the episode ends (`async with`): left to the garbage collector, it may be closed from another
    # thread's event loop, which once left another episode's request unanswered until its timeout.
    async with AsyncOpenAI(base_url=str(client.base_url), api_key="cleanrlhf", max_retries=0) as episode:
        adder = Agent(OpenAIChatModel(name, provider=OpenAIProvider(openai_client=episode)), retries=0)
        first = await adder.run(example["prompt"])
        if score(first.output, example["label"]) > 0:
            return 1.0
        second = await adder.run("Wrong, try again.", message_history=first.all_messages())
        return 0.5 * score(second.output, example["label"])
