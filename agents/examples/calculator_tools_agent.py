"""A chat agent with a calculator *tool* (OpenAI function calling), every answer streamed:

    python algos/grpo.py --actor.model.name-or-path <a chat model> --rollout.agent-file agents/examples/calculator_tools_agent.py

The agent asks the question (`37+05=`) as a user message with the `calculator` tool in `tools`, and reads the answer
as server-sent events (`stream=True`): content deltas, then the tool calls. An answer with tool calls gets each call
run by the calculator (`a op b`, op in + - *) and its result sent back as a `tool` message; a second streamed turn then
gives the final answer. An answer without tool calls is the final answer. The reward is `rewards.arithmetic.score` of
the final answer's text.

SFT demonstrations for a model that has never seen a tool call (`demonstrations`): each question's first answer is a
Hermes tool call with the question's expression (with probability `tool_share`) or an attempt in the head, and
every call is followed by the turn that copies the calculator's result. The prompts are rendered exactly as the
agent server renders them for a template that ignores `tools` (`render_turns`: the tool list in the Hermes layout
in a system turn, results in `<tool_response>` blocks of a user turn; tests/test_tool_agent.py checks it token for
token), so an SFT model sees at RL time what it was trained on:

    python agents/examples/calculator_tools_agent.py --out runs/calc-tools    # writes the task and the SFT data

It also prints the recipe for the embedded `cleanrlhf/tiny-chat` (~0.1 M parameters): SFT on the short prompts
(`STAGE1_FLAGS`: the copies of the question's expression into the call and of the result into the answer form
there), SFT on the prompts as served (`STAGE2_FLAGS`), then GRPO through this agent (`GRPO_FLAGS`), in which the
tool-call rate and pass@1 rise (tests/test_tool_agent.py runs it; docs/agents.md, "Native tool calls on tiny-chat",
has the runs).

It is also the agent of `tests/benchmarks/bench_agents.py --parts tools`, which times the server's path with tools
rendered into the prompt and every answer streamed on the untrained `cleanrlhf/tiny-chat`: there nearly every
episode is one streamed call, since a random model almost never writes a well-formed call.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from agents.examples.calculator_agent import task_rows, write_jsonl
from agents.tool_calls import hermes_call_text, hermes_tools_prompt, render_chat
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


# ---------------------------------------------------------------------------------------------------------------
# The SFT demonstrations: the agent's two turns, rendered as the server renders them


def render_turns(
    tokenizer, question: str, call: str | None = None, result: str | None = None, tools: bool = True
) -> str:
    """The prompt text the agent server builds for `tokenizer` (a chat template that ignores `tools`, such as
    `cleanrlhf/tiny-chat`'s) at this agent's first turn (`call` None) or, after the model wrote the tool call `call`
    and the calculator answered `result`, at its second: the `CALCULATOR` list in the Hermes layout as the system
    turn, the question, then the model's call as its own turn and the result as a `<tool_response>` in a user turn.
    `tools=False` leaves the tool list out (the template's default system turn instead): the short prompts of the
    first SFT stage."""
    system = [{"role": "system", "content": hermes_tools_prompt([CALCULATOR])}] if tools else []
    messages = system + [{"role": "user", "content": question}]
    if call is not None:
        messages += [{"role": "assistant", "content": call},
                     {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}]  # fmt: skip
    return render_chat(tokenizer, messages)


def demonstrations(tokenizer, rows: list[dict], tool_share: float, seed: int = 0, tools: bool = True) -> list[dict]:
    """SFT rows (`prompt` text as rendered by `render_turns`, `answer`) from the calculator task's rows: for each
    question one first answer, a Hermes call of `calculator` on the question's expression with probability
    `tool_share` and the product (an attempt in the head) otherwise, and the second turn after such a call, whose
    answer copies the calculator's result. The first answers set how often the SFT model calls; the copies teach it
    to use the result. `tools=False`: the prompts without the tool list."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        question, arguments = row["prompt"], {"expression": row["prompt"].rstrip("=")}
        call = hermes_call_text(CALCULATOR["function"]["name"], arguments)
        first = call if rng.random() < tool_share else row["answer"]
        out.append({"prompt": render_turns(tokenizer, question, tools=tools), "answer": first})
        result = calculate(json.dumps(arguments))  # the tool as the agent runs it: on the call's JSON arguments
        out.append({"prompt": render_turns(tokenizer, question, call, result, tools), "answer": result})
    rng.shuffle(out)
    return out


def write_data(out: Path, tokenizer, tool_share: float = 0.5, seed: int = 0) -> tuple[Path, Path, Path]:
    """`out/mul2/{train,test}.jsonl` (the RL task: `37*05=` -> `0185`), `out/sft-short/` (the demonstrations without
    the tool list: SFT stage 1) and `out/sft/` (as the server renders them: stage 2), rendered for `tokenizer`."""
    train, test = task_rows(seed)
    write_jsonl(out / "mul2" / "train.jsonl", train)
    write_jsonl(out / "mul2" / "test.jsonl", test)
    for name, tools in (("sft-short", False), ("sft", True)):
        write_jsonl(out / name / "train.jsonl", demonstrations(tokenizer, train, tool_share, seed, tools))
        write_jsonl(out / name / "test.jsonl", demonstrations(tokenizer, test, tool_share, seed + 1, tools))
    return out / "mul2", out / "sft-short", out / "sft"


# The recipe (docs/agents.md, "Native tool calls on tiny-chat"): the copies form within the short prompts, then carry
# over to the ~500-token prompts with the tool list; a call and its answer are ~80 tokens, far above the task's 8.
STAGE1_FLAGS = ("--train.max-steps 1000 --train.lr 3e-3 --train.min-lr-ratio 0.5 --train.batch-size 32 "
                "--train.warmup-steps 0 --eval.every 200 --eval.max-samples 64 --eval.no-generate")  # fmt: skip
STAGE2_FLAGS = ("--train.max-steps 300 --train.lr 1e-3 --train.min-lr-ratio 0.5 --train.batch-size 32 "
                "--train.warmup-steps 0 --train.pack-row-len 640 --eval.every 200 --eval.max-samples 64 "
                "--eval.no-generate")  # fmt: skip
# --actor.lr-ref-samples 64: the recipe's 3e-4 was tuned at its own 16 x 8 / 2 = 64 samples per optimizer step
GRPO_FLAGS = ("--rollout.max-new-tokens 96 --rollout.batch-size 16 --train.max-steps 15 --eval.every 5 "
              "--eval.max-samples 64 --actor.lr-ref-samples 64")  # fmt: skip


if __name__ == "__main__":
    from core import models
    from core.embedded import resolve_model

    ap = argparse.ArgumentParser(
        description="write the tool-calling calculator task's data and print the three commands that train on it"
    )
    ap.add_argument("--out", default="runs/calc-tools")
    ap.add_argument("--model", default="cleanrlhf/tiny-chat", help="the chat model the demonstrations are rendered for")
    ap.add_argument("--tool-share", type=float, default=0.5, help="share of SFT first answers that are calls")
    opts = ap.parse_args()
    task, short, sft = write_data(Path(opts.out), models.load_tokenizer(resolve_model(opts.model)), opts.tool_share)
    print(f"data: {task} (RL task), {short} and {sft} (SFT demonstrations for {opts.model})\n")
    o = opts.out
    print(f"python algos/sft.py --model.name-or-path {opts.model} --data.path {short} {STAGE1_FLAGS} "
          f"--export-dir {o}/sft1-model --run-dir {o}/sft1-run")  # fmt: skip
    print(f"python algos/sft.py --model.name-or-path {o}/sft1-model --data.path {sft} {STAGE2_FLAGS} "
          f"--export-dir {o}/sft2-model --run-dir {o}/sft2-run")  # fmt: skip
    print(f"python algos/grpo.py --actor.model.name-or-path {o}/sft2-model --data.path {task} "
          f"--rollout.agent-file agents/examples/calculator_tools_agent.py {GRPO_FLAGS} --run-dir {o}/grpo-run")  # fmt: skip
