"""tests/benchmarks/bench_agents.py at a tiny size: it runs to the end and reports finite, positive numbers for its
measurements (the timings themselves are the script's business, not the suite's); and the tool branch of its
tools-and-streaming agent (agents/examples/calculator_tools_agent.py), which the benchmark's random model never takes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))


@pytest.mark.slow
def test_bench_agents_runs_at_a_tiny_size(one_thread, capsys):
    from bench_agents import main

    result = main(["--parts", "abc", "--episodes", "8", "--concurrency", "1", "4", "--repeats", "1"])
    assert set(result["throughput"]) == set(result["overhead"]) == {1, 4}
    assert result["throughput"][1]["speedup"] == 1.0 and result["calls_example_agent"] >= 8
    for r in result["throughput"].values():
        assert math.isfinite(r["episodes_per_s"]) and r["episodes_per_s"] > 0
    for r in result["overhead"].values():
        assert r["server_ms_per_call"] > 0 and r["direct_ms_per_call"] > 0 and math.isfinite(r["overhead"])
        assert r["client_ms_per_call"] > 0 and math.isfinite(r["floor"])  # the canned server answered every call
    assert '"bench": "agents"' in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.slow
def test_bench_agents_tools_part_runs_at_a_tiny_size(one_thread, capsys):
    """(d) alone: the tools-and-streaming agent on tiny-chat at concurrency 1 and 4 (~20 s)."""
    from bench_agents import main

    result = main(["--parts", "tools", "--episodes", "8", "--concurrency", "1", "4", "--repeats", "1"])
    assert set(result) == {"tools"}
    tools = result["tools"]
    assert set(tools["throughput"]) == {1, 4} and tools["calls"] >= 8
    assert tools["prompt_tokens_mean"] > tools["plain_prompt_tokens_mean"]  # the tool list is in the prompt
    assert tools["throughput"][1]["speedup"] == 1.0
    for r in tools["throughput"].values():
        for key in ("episodes_per_s", "episodes_per_cpu_s", "speedup", "speedup_cpu", "plain_episodes_per_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["direct_ms_per_call"] > 0
    assert '"bench": "agents"' in capsys.readouterr().out.splitlines()[-1]


def test_calculator_tools_agent_follows_a_tool_call_with_a_second_streamed_turn():
    """The tool branch the tiny random model never takes: a stand-in engine answers a Hermes tool call first and the
    sum once the prompt holds the calculator's result; the agent streams both turns and earns the reward."""
    from agents.openai_agent import OpenAIAgentExecutor
    from core import embedded, models
    from core.rollout import Sample

    tok = models.load_tokenizer(str(embedded.ensure_tiny_chat()))
    eos = tok.eos_token_id
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37+05"}}\n</tool_call>'

    class Engine:
        def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
            out = []
            for p in prompts:
                text = "42" if "<tool_response>\n42\n</tool_response>" in tok.decode(p) else call
                ids = tok(text, add_special_tokens=False)["input_ids"] + [eos]
                out.append([Sample(ids, [-0.1] * len(ids), "stop", False)])
            return out

    agent = Path(__file__).resolve().parents[1] / "agents" / "examples" / "calculator_tools_agent.py"
    ex = OpenAIAgentExecutor(Engine(), tok, str(agent), "cleanrlhf/tiny-chat", max_new_tokens=64, max_context=1024)
    try:
        rollout = ex.run([{"prompt": "37+05=", "prompt_ids": [], "label": "042", "datasource": "add2"}], 1, 1, 0)
    finally:
        ex.close()
    assert rollout.logs["rollout/agent_errors"] == 0 and rollout.logs["rollout/agent_calls_mean"] == 2
    assert rollout.logs["rollout/agent_tool_calls_mean"] == 1 and rollout.rewards.tolist() == [1.0]
