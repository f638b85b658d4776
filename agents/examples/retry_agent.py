"""A two-call agent for the embedded arithmetic task, and the example of a `--rollout.agent-file`:

    python algos/grpo.py --rollout.agent-file agents/examples/retry_agent.py

The agent asks the policy for `a+b=` through the OpenAI completions API. A right first answer earns 1.0. A wrong one
is followed by a second call whose prompt is the first exchange, a newline and the question again (the agent's own
text: not trained on), and a right second answer earns 0.5. The same episode as agents/retry_env.py, written as an
agent: the server keeps the model's first answer as the tokens it sampled, so the second call's prompt continues the
first call and the episode trains on both answers.
"""

from __future__ import annotations

from rewards.arithmetic import score


async def agent(client, example: dict) -> float:
    question = example["prompt"]
    first = await client.completions.create(model="policy", prompt=question)
    answer = first.choices[0].text
    if score(answer, example["label"]) > 0:
        return 1.0
    second = await client.completions.create(model="policy", prompt=question + answer + "\n" + question)
    return 0.5 * score(second.choices[0].text, example["label"])
