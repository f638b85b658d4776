"""`python -m agents.openai_server --model DIR` (agents/serve.py `serve`): an exported model served with the
OpenAI API the RL agents use, started as a real process and called with the `openai` client; its refusals of bad
flags; and its clean exit on SIGTERM / SIGINT."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "cleanrlhf/tiny-chat"


@contextlib.contextmanager
def served(model: str, log: Path, *flags: str, timeout_s: float = 120.0):
    """Start the server over `model` on a free port (`--port 0`), wait until `/v1/models` answers, yield
    `(process, base_url)`; the process is ended (SIGTERM) if the body left it running. stdout / stderr go to `log`
    (a pipe nobody reads would fill and stall the server)."""
    import requests

    from core import embedded

    embedded.resolve_model(model)  # builds the embedded model here, so the server's start-up time is the server's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agents.openai_server", "--model", model, "--port", "0",
                                 "--log-dir", str(log.parent), *flags], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline, url = time.monotonic() + timeout_s, None
        while url is None:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-3000:]}"
            m = re.search(r" at (http://\S+/v1) ", log.read_text())
            url = m.group(1) if m else None
            time.sleep(0.2)
        assert requests.get(f"{url}/models", timeout=10).json()["data"][0]["id"] == model
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_checkpoint_is_served_with_the_openai_api_and_stops_on_a_signal(tmp_path, sig):
    """Chat, completion and a streamed chat through the `openai` client at temperature 0 (greedy: the stream must
    be the same text as the plain answer), the alias `policy`, an unknown model refused, then exit 0 on `sig`."""
    import openai

    with served(MODEL, tmp_path / "serve.log", "--max-new-tokens", "16") as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="none")
        assert [m.id for m in client.models.list()] == [MODEL]
        messages = [{"role": "user", "content": "What is 2+3?"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 8
        assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
        again = client.chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=8)
        assert again.choices[0].message.content == chat.choices[0].message.content  # greedy, nothing remembered
        stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                stream=True)  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == chat.choices[0].message.content
        done = client.completions.create(model=MODEL, prompt="2+3=", temperature=0, max_tokens=16, logprobs=1)
        assert 1 <= done.usage.completion_tokens <= 16 and done.choices[0].finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in done.choices[0].logprobs.token_logprobs)
        top = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                             logprobs=True, top_logprobs=3)  # fmt: skip
        assert top.choices[0].message.content == chat.choices[0].message.content
        for tok in top.choices[0].logprobs.content:  # greedy: the sampled token is the engine's top 1
            assert len(tok.top_logprobs) == 3 and tok.top_logprobs[0].logprob >= tok.logprob - 1e-6
            assert tok.top_logprobs[0].token == tok.token
        legacy = client.completions.create(model=MODEL, prompt="2+3=", temperature=0, max_tokens=4, logprobs=2)
        for lp, best in zip(legacy.choices[0].logprobs.token_logprobs, legacy.choices[0].logprobs.top_logprobs):
            assert len(best) == 2 and max(best.values()) >= lp - 1e-6
        sampled = client.completions.create(model=MODEL, prompt="2+3=", temperature=1.0, seed=3, max_tokens=16, n=2)
        assert len(sampled.choices) == 2
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="gpt-4", prompt="2+3=", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=MODEL, prompt="2+3=", max_tokens=4, temperature=-1)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert "stopped" in (tmp_path / "serve.log").read_text()


def test_a_path_that_is_no_model_folder_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "nope", tmp_path / "empty"):
        out = subprocess.run([sys.executable, "-m", "agents.openai_server", "--model", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"--model {path}: not a model folder" in out.stderr


def test_a_port_in_use_is_refused_naming_it(tmp_path):
    from core import embedded

    path = embedded.resolve_model(MODEL)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "agents.openai_server", "--model", path, "--port", str(port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--port {port}: cannot listen there" in out.stderr


def test_the_agent_server_flags_are_listed_by_the_rl_scripts():
    """`--rollout.agent-tool-parser` and `--rollout.agent-max-request-bytes` reach `--help` (core/rl.py passes them
    to `OpenAIAgentExecutor`), with the server's defaults."""
    out = subprocess.run([sys.executable, str(ROOT / "algos" / "grpo.py"), "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--rollout.agent-tool-parser", "--rollout.agent-max-request-bytes"):
        assert flag in out.stdout, flag
    from agents.request_checks import MAX_REQUEST_BYTES
    from core.config import RolloutArgs

    defaults = RolloutArgs(batch_size=1, n_samples=1)  # the recipe fields have no default in core
    assert defaults.agent_tool_parser == "hermes" and defaults.agent_max_request_bytes == MAX_REQUEST_BYTES


@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.slow), "hf"])  # vllm: ~13 s
def test_the_engines_return_top_logprobs_and_stop_at_a_stop_string(engine, one_thread):
    """core/rollout.py `generate(..., top_logprobs=k, stop=[...])` on `cleanrlhf/tiny-sft` (greedy, 2-digit addition):
    k entries per token whose largest is the sampled token's log-prob (greedy samples the top 1); asking for them
    changes neither the tokens nor their log-probs; vLLM ends the sample at the token completing a stop string, which
    is kept (the HF engine takes `stop` and generates on: the server cuts)."""
    from transformers import AutoTokenizer

    from core import embedded, rollout

    path = embedded.resolve_model("cleanrlhf/tiny-sft")
    tok = AutoTokenizer.from_pretrained(path)
    engines = rollout.create_engines(path, rollout.VLLMConfig(engine=engine, max_model_len=64, kv_cache_gib=0.25))
    try:
        prompts = [tok("12+30=")["input_ids"], tok("7+8=")["input_ids"]]
        plain = engines.generate(prompts, max_new_tokens=6, temperature=0.0, seed=1)
        top = engines.generate(prompts, max_new_tokens=6, temperature=0.0, seed=1, top_logprobs=3)
        for a, b in zip(plain, top):
            a, b = a[0], b[0]
            assert a.top_logprobs is None and (b.token_ids, b.logprobs) == (a.token_ids, a.logprobs)
            assert len(b.top_logprobs) == len(b.token_ids)
            for t, lp, best in zip(b.token_ids, b.logprobs, b.top_logprobs):
                assert len(best) == 3 and max(best, key=best.get) == t and max(best.values()) >= lp - 1e-6
        text = tok.decode(plain[0][0].token_ids, skip_special_tokens=True)
        stopped = engines.generate(prompts[:1], max_new_tokens=6, temperature=0.0, seed=1, stop=[text[:2]])[0][0]
        if engine == "vllm":
            assert tok.decode(stopped.token_ids) == text[:2] and stopped.finish_reason == "stop"
        else:
            assert stopped.token_ids == plain[0][0].token_ids
    finally:
        engines.shutdown()
