"""Agent frameworks, unchanged, as `--rollout.agent-file` agents (item 2 of "Agents on the OpenAI API as agent
frameworks speak it"): pydantic-ai (agents/examples/pydantic_ai_agent.py) and the OpenAI Agents SDK
(agents/examples/openai_agents_sdk_agent.py) point their own OpenAI clients at the episode's server.

The embedded model writes nonsense, so what is checked is the plumbing, not the answers: every request the framework
sends is answered (no 4xx, no failed episode), each episode makes its two calls as one conversation (the second
continues the first), the tokens trained on are exactly the ones the engine sampled for those calls (with their
log-probs), and grpo.py completes a short run on the framework's episodes with a finite loss.

The SDK's import name `agents` is also this repo's package, so its tests run in a subprocess where the SDK comes first
on `sys.path` (PYTHONPATH, the repo root not on the path) and the repo's own modules are found by the editable
install's finder; see docs/agents.md. They are skipped when the SDK is not installed ($CLEANRLHF_OPENAI_AGENTS_SDK, or
.venv/openai-agents-sdk: `pip install --no-deps --target .venv/openai-agents-sdk "openai-agents==0.24.0"`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYDANTIC_AI = ROOT / "agents" / "examples" / "pydantic_ai_agent.py"
OPENAI_AGENTS = ROOT / "agents" / "examples" / "openai_agents_sdk_agent.py"
NAME = "cleanrlhf/tiny-sft"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


def run_agent_file(agent_file: str, n_rows: int = 4, n: int = 2) -> dict:
    """Run `agent_file` through `OpenAIAgentExecutor` on the embedded SFT model (an in-process vLLM engine) and check
    each episode against the calls the server recorded. Returns the rollout's logs, the rewards and, per episode, the
    checks as booleans (JSON-able, so a subprocess can run it)."""
    import torch
    from conftest import in_process_engines

    from agents.openai_agent import OpenAIAgentExecutor
    from core import embedded, models

    torch.set_num_threads(1)
    path = str(embedded.ensure_sft_warm_start())
    tok = models.load_tokenizer(path)
    engines_gen = in_process_engines(path, "float32")
    engines = next(engines_gen)
    ex = OpenAIAgentExecutor(engines, tok, agent_file, NAME, max_new_tokens=8, max_context=128)
    opened, closed = [], {}  # episode ids in the order the executor opened them (the rows' order), their records
    open_episode, close_episode = ex.server.open_episode, ex.server.close_episode

    def track(*a, **k):
        opened.append(open_episode(*a, **k))
        return opened[-1]

    def keep(eid):
        closed[eid] = close_episode(eid)
        return closed[eid]

    ex.server.open_episode, ex.server.close_episode = track, keep
    sums = [(37, 5), (12, 30), (50, 49), (8, 8)][:n_rows]
    batch = [{"prompt": f"{a:02d}+{b:02d}=", "prompt_ids": tok.encode(f"{a:02d}+{b:02d}="), "label": f"{a + b:03d}",
              "datasource": "add2"} for a, b in sums]  # fmt: skip
    try:
        ro = ex.run(batch, n=n, seed=5, step=0)
    finally:
        ex.close()
        next(engines_gen, None)
    checks = []
    for e, eid in zip(ro.episodes, opened, strict=True):
        calls = closed[eid].calls
        trained_logprobs = [lp for lp, m in zip(e.logprobs, e.action_mask) if m]
        checks.append({
            "calls": len(calls),
            "continues": all(c.parent == i for i, c in enumerate(calls[1:])),  # one conversation, not two chains
            "prompt_is_the_rendered_chat": e.prompt_ids == calls[0].prompt_ids,
            "trained_tokens_are_sampled": _trained(e) == _sampled(calls, tok.eos_token_id),
            "logprobs_are_the_engines": trained_logprobs == _sampled_logprobs(calls, tok.eos_token_id),
            "masked_only_between_calls": e.action_mask[0] == 1 and e.action_mask[-1] == 1,
        })  # fmt: skip
    return {"logs": ro.logs, "rewards": ro.rewards.tolist(), "episodes": checks}


def _trained(e) -> list[int]:
    return [t for t, m in zip(e.token_ids, e.action_mask) if m]


def _kept(calls, eos: int) -> list[list[int]]:
    """Each call's sampled ids as the trajectory keeps them: a call the next one continues loses a trailing eos
    that its text does not carry (agents/openai_server.py `build_trajectory`)."""
    out = []
    for i, c in enumerate(calls):
        ids = list(c.token_ids)
        if i < len(calls) - 1 and ids and ids[-1] == eos:
            ids = ids[:-1]
        out.append(ids)
    return out


def _sampled(calls, eos: int) -> list[int]:
    return [t for ids in _kept(calls, eos) for t in ids]


def _sampled_logprobs(calls, eos: int) -> list[float]:
    return [lp for c, ids in zip(calls, _kept(calls, eos)) for lp in c.logprobs[: len(ids)]]


def assert_framework_episodes(out: dict, n_episodes: int) -> None:
    logs = out["logs"]
    assert logs["rollout/agent_errors"] == 0 and logs["rollout/agent_bad_requests"] == 0, logs
    assert len(out["episodes"]) == n_episodes and set(out["rewards"]) <= {0.0, 0.5, 1.0}
    assert 1.0 <= logs["rollout/agent_calls_mean"] <= 2.0 and logs["rollout/agent_dropped_calls"] == 0, logs
    for checks in out["episodes"]:
        assert all(checks.values()), checks
    assert any(c["calls"] == 2 for c in out["episodes"]), "no episode got the retry turn"


def sdk_path() -> str:
    """Where the OpenAI Agents SDK is installed apart from .venv's site-packages; skips the test when it is not."""
    path = Path(os.environ.get("CLEANRLHF_OPENAI_AGENTS_SDK", ROOT / ".venv" / "openai-agents-sdk"))
    if not (path / "agents" / "run.py").is_file():
        pytest.skip(f"the OpenAI Agents SDK is not installed at {path} (pip install --no-deps --target {path} "
                    f"'openai-agents==0.24.0', or set CLEANRLHF_OPENAI_AGENTS_SDK)")  # fmt: skip
    return str(path)


def run_with_sdk(code_or_args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """A Python process where `import agents` is the SDK: PYTHONPATH puts it first, the working directory is not the
    repo root (the repo's `agents` is then found only for its submodules, through the editable install)."""
    # not what earlier tests left in this process's environment (a process group's MASTER_PORT, still bound here)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV and not k.startswith("VLLM_")}
    env["PYTHONPATH"] = sdk_path()
    return subprocess.run([sys.executable, *code_or_args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


# ----------------------------------------------------------------------------------------------------- pydantic-ai
def test_pydantic_ai_agent_is_answered_and_trains_on_the_sampled_tokens(one_thread):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -e '.[frameworks]'")
    assert_framework_episodes(run_agent_file(str(PYDANTIC_AI)), 8)


@pytest.mark.slow
def test_grpo_trains_on_pydantic_ai_episodes(tmp_path, one_thread):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -e '.[frameworks]'")
    from algos.grpo import Args, main

    args = Args()
    args.rollout.agent_file = str(PYDANTIC_AI)
    args.rollout.agent_timeout_s = 60  # an episode left waiting (an unclosed client) fails the test in a minute
    args.train.max_steps, args.rollout.batch_size, args.train.micro_batch_size = 2, 16, 64
    args.eval.every, args.eval.max_samples = 2, 32
    # the tiny model rarely earns a reward in chat form: keep every group, so that each step updates on the
    # framework's episodes (with the filter a step of all-zero groups has nothing to update on)
    args.algo.filter_zero_variance = False
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    summary = main(args)
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps)
    assert all(r["rollout/agent_errors"] == 0 and r["rollout/agent_bad_requests"] == 0 for r in steps), steps
    assert all(1.0 <= r["rollout/agent_calls_mean"] <= 2.0 for r in steps)


# ------------------------------------------------------------------------------------------- OpenAI Agents SDK
def test_the_repo_package_shadows_the_sdk_from_the_repo_root():
    """From the repo root (`python -m pytest`, `python -c`) the repo's `agents` wins and the SDK cannot be imported
    under its own name; with the SDK first on the path both work. What docs/agents.md tells users."""
    sdk = sdk_path()
    probe = "import agents, agents.openai_agent; from agents import Runner; print(agents.__file__)"
    root = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(os.environ, PYTHONPATH=sdk),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert root.returncode != 0 and "cannot import name 'Runner'" in root.stderr, root.stderr[-500:]
    elsewhere = run_with_sdk(["-c", probe], ROOT / "algos", 120)
    assert elsewhere.returncode == 0 and elsewhere.stdout.strip().startswith(sdk), elsewhere.stderr[-2000:]


def test_openai_agents_sdk_agent_is_answered_and_trains_on_the_sampled_tokens(tmp_path):
    sdk_path()
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_frameworks as t; "
            f"print('RESULT', json.dumps(t.run_agent_file({str(OPENAI_AGENTS)!r})))")  # fmt: skip
    proc = run_with_sdk(["-c", code], tmp_path, 600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert_framework_episodes(json.loads(lines[-1][len("RESULT ") :]), 8)


@pytest.mark.slow
def test_grpo_trains_on_openai_agents_sdk_episodes(tmp_path):
    """The user's command: `PYTHONPATH=<sdk> python algos/grpo.py --rollout.agent-file <the SDK example>`."""
    sdk_path()
    run = tmp_path / "run"
    flags = ["--rollout.agent-file", str(OPENAI_AGENTS), "--train.max-steps", "2", "--rollout.batch-size", "16",
             "--train.micro-batch-size", "64", "--eval.every", "2", "--eval.max-samples", "32", "--logger.quiet",
             "--logger.no-tensorboard", "--algo.no-filter-zero-variance", "--run-dir", str(run)]  # fmt: skip
    proc = run_with_sdk([str(ROOT / "algos" / "grpo.py"), *flags], ROOT, 900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps)
    assert all(r["rollout/agent_errors"] == 0 and r["rollout/agent_bad_requests"] == 0 for r in steps), steps
