"""An agent file (`--rollout.agent-file`) is checked before anything loads: a syntax error, an `agent` that is not
`async def` (and a `--run-dir` that is a file) stop an RL script before DeepSpeed, Ray or vLLM is imported, naming
the file and the line. An `await` left out fails its episodes with a message naming the agent file's lines: where
the coroutine was used and the call that was not awaited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.openai_agent import AgentError, OpenAIAgentExecutor, check_agent_file, load_agent

ROOT = Path(__file__).resolve().parents[1]

SYNC_AGENT = """import math


def agent(client, example):
    return 1.0
"""
SYNTAX_ERROR = "import asyncio\n\nasync def agent(client, example):\n    return 1 +\n"


def test_an_agent_that_is_not_async_is_named_with_its_line(tmp_path):
    path = tmp_path / "sync_agent.py"
    path.write_text(SYNC_AGENT)
    with pytest.raises(AttributeError, match=rf"^--rollout.agent-file {path}, line 4: `agent` is not an `async def`"):
        load_agent(str(path))
    (tmp_path / "none.py").write_text("AGENT = 1\n")
    with pytest.raises(AttributeError, match=r"none\.py: defines no `agent`; write `async def agent"):
        load_agent(str(tmp_path / "none.py"))


def test_the_checked_agent_file_is_imported_once(tmp_path):
    """The check at the run's start imports the file; the executor made later uses that import (a module with side
    effects at import runs them once), and a file changed since is imported again."""
    path = tmp_path / "counted.py"
    path.write_text("import builtins\nbuiltins.IMPORTS = getattr(builtins, 'IMPORTS', 0) + 1\n\n"
                    "async def agent(client, example):\n    return 1.0\n")  # fmt: skip
    import builtins

    builtins.IMPORTS = 0
    check_agent_file(str(path))
    fn = load_agent(str(path))
    assert builtins.IMPORTS == 1 and fn.__name__ == "agent"
    load_agent(str(path))  # a second executor: imported again, as before
    assert builtins.IMPORTS == 2
    del builtins.IMPORTS


PROBE = """
import json, sys
from algos import grpo
out = []
for agent_file, run_dir in json.loads(sys.argv[1]):
    args = grpo.Args(run_dir=run_dir)
    args.rollout.agent_file = agent_file
    args.logger.quiet = True
    try:
        grpo.main(args)
        out.append(["no error", ""])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
out.append(sorted(m for m in ("deepspeed", "vllm", "ray") if m in sys.modules))
print("RESULT " + json.dumps(out))
"""


def test_grpo_stops_on_a_bad_agent_file_or_run_dir_before_loading_anything(tmp_path):
    """grpo.py with an agent file that does not compile, one whose `agent` is a plain `def`, or a `--run-dir` that is
    a file: each stops in one error naming the flag, the file and the line, before DeepSpeed, Ray or vLLM is even
    imported (they used to be reported once those had loaded, a minute or more on a CPU)."""
    syntax, sync, a_file = tmp_path / "bad_syntax.py", tmp_path / "sync_agent.py", tmp_path / "notes.txt"
    syntax.write_text(SYNTAX_ERROR)
    sync.write_text(SYNC_AGENT)
    a_file.write_text("mine")
    cases = [[str(syntax), str(tmp_path / "run1")], [str(sync), str(tmp_path / "run2")], [None, str(a_file)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *errors, loaded = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert errors[0][0] == "ValueError" and errors[0][1].startswith(
        f"--rollout.agent-file {syntax}, line 4, column"
    ), errors[0]  # fmt: skip
    assert errors[1][0] == "AttributeError" and errors[1][1].startswith(
        f"--rollout.agent-file {sync}, line 4: `agent` is not an `async def` function"
    ), errors[1]  # fmt: skip
    assert errors[2] == ["ValueError", f"--run-dir {a_file}: is a file, not a folder; give a folder for the run (it "
                                       "is created if missing)"]  # fmt: skip
    assert loaded == [], f"loaded before the error: {loaded}"
    assert not (tmp_path / "run1").exists() and not (tmp_path / "run2").exists() and a_file.read_text() == "mine"


# ----------------------------------------------------------------------------------- an `await` left out
class NoEngines:
    """The agents below fail before they send a request: nothing is generated."""

    def generate(self, *a, **k):
        raise AssertionError("no request expected")


@pytest.fixture(scope="module")
def executor_for(tiny_path):
    from core import models

    tok = models.load_tokenizer(str(tiny_path))
    made = []

    def make(path: Path) -> OpenAIAgentExecutor:
        made.append(OpenAIAgentExecutor(NoEngines(), tok, str(path), "tiny", 8, 64, timeout_s=30))
        return made[-1]

    yield make, tok
    for ex in made:
        ex.close()


def _rows(tok) -> list[dict]:
    return [{"prompt": p, "prompt_ids": tok.encode(p), "label": "042"} for p in ("37+05=", "12+30=")]


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the agents' own bug
@pytest.mark.parametrize(
    "body, said",
    [
        (  # the value of an unawaited call used: the line that used it, and the call
            "async def agent(client, example):\n"
            "    out = client.completions.create(model='policy', prompt=example['prompt'])\n"
            "    return float(out.choices[0].text == example['label'])\n",
            r"raised: AttributeError: 'coroutine' object has no attribute 'choices' \(at {path} line 3: "
            r"`return float\(out.choices\[0\].text == example\['label'\]\)`\); not awaited in {path}: line 2: "
            r"`out = client.completions.create\(model='policy', prompt=example\['prompt'\]\)` \(write `await`",
        ),
        (  # an unawaited call returned: the agent's own async helper
            "async def score(client, example):\n"
            "    return 1.0\n\n\n"
            "async def agent(client, example):\n"
            "    return score(client, example)\n",
            r"bad_reward: returned a coroutine of `score` \(called without `await`\); not awaited in {path}: line 6: "
            r"`return score\(client, example\)`",
        ),
        (  # an unawaited call whose result is dropped: no request was sent
            "async def agent(c, example):\n"
            "    c.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'hi'}])\n"
            "    return 1.0\n",
            r"no_calls: the agent made no model call: there is nothing to train on; not awaited in {path}: line 2: "
            r"`c.chat.completions.create\(",
        ),
    ],
)
def test_a_left_out_await_names_the_agent_files_lines(executor_for, tmp_path, body, said):
    make, tok = executor_for
    path = tmp_path / "my_agent.py"
    path.write_text(body)
    ex = make(path)
    with pytest.raises(AgentError, match=said.format(path=str(path).replace(".", r"\."))):
        ex.run(_rows(tok), n=1, seed=0, step=3)
