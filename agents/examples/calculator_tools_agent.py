"""A chat agent with a calculator *tool* (OpenAI function calling), every answer streamed:

    python algos/grpo.py --actor.model.name-or-path <a chat model> --rollout.agent-file agents/examples/calculator_tools_agent.py

The agent asks the question (`37+05=`) as a user message with the `calculator` tool in `tools`, and reads the answer
as server-sent events (`stream=True`): content deltas, then the tool calls. An answer with tool calls gets each call
run by the calculator (`a op b`, op in + - *) and its result sent back as a `tool` message; a second streamed turn then
gives the final answer. An answer without tool calls is the final answer. The reward is `rewards.arithmetic.score` of
the final answer's text.

What it is for: `tests/benchmarks/bench_agents.py --parts tools` uses it to time the server's path with tools
rendered into the prompt (the Hermes layout, for a template that ignores `tools`) and the answer streamed. The
benchmark runs it on `cleanrlhf/tiny-chat`, a random untrained model that almost never writes a well-formed
`<tool_call>`: nearly every episode there is one streamed call, and the tool branch is the code path of a trained
chat model (e.g. Qwen2.5-Instruct), not what the benchmark's numbers measure.
"""

from __future__ import annotations

import json
import re

from rewards.arithmetic import score

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate `a op b` for integers a, b and op one of + - *.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 37+05"}},
                   "required": ["expression"]}}}  # fmt: skip
_EXPRESSION = re.compile(r"^\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*$")


def calculate(arguments: str) -> str:
    """The tool: `arguments` as the model wrote them (a JSON object with `expression`), the result as text, or an
    error message the model can read (it may write anything)."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object with an `expression`"
    m = _EXPRESSION.match(str(expression))
    if m is None:
        return f"error: cannot evaluate {expression!r}"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


async def streamed_turn(client, messages: list[dict]) -> tuple[str, list[dict]]:
    """One streamed chat completion: (the content, the tool calls as OpenAI's message `tool_calls`). Tool call
    pieces are joined by their index, as OpenAI may split a call's arguments over chunks (this server sends each call
    whole, in one chunk)."""
    stream = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], stream=True)
    content, calls = [], {}
    async for chunk in stream:
        if not chunk.choices:  # a usage chunk
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for piece in delta.tool_calls or []:
            call = calls.setdefault(
                piece.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["function"]["name"] += piece.function.name or ""
                call["function"]["arguments"] += piece.function.arguments or ""
    return "".join(content), [calls[i] for i in sorted(calls)]


async def agent(client, example: dict) -> float:
    messages = [{"role": "user", "content": example["prompt"]}]
    content, tool_calls = await streamed_turn(client, messages)
    if not tool_calls:
        return score(content, example["label"])
    # the model's turn with its calls, then one `tool` message per call
    messages.append({"role": "assistant", "content": content or None, "tool_calls": tool_calls})
    for call in tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": calculate(call["function"]["arguments"])}
        )
    content, _ = await streamed_turn(client, messages)  # the final answer (more calls are not followed)
    return score(content, example["label"])
