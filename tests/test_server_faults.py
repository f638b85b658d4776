"""The agent server (agents/openai_server.py) against requests meant to break it and flags that cannot work: every
sampling value is checked against what the engine takes (400 naming the field; a seed the engine refused left the
in-process vLLM engine spinning on its half-added request), a lone surrogate is a 400, an engine error fails only its
request (500) and the server goes on, in `serve` and inside a training run's executor; the key (`--api-key`, 401), a
body that is not JSON (415), a `--host` other machines reach refused without a key; `--port`, `--max-context` and a
damaged weights file named in one line; the libraries' messages in a log file.

The fast tests stand a scripted engine in for vLLM; the real in-process engine runs where the fault is the engine's
(`engines`), and `python -m agents.openai_server` (agents/serve.py) runs as a process where the fault is the
command's."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import in_process_engines

from agents.batcher import Batcher
from agents.openai_agent import OpenAIAgentExecutor
from agents.openai_server import SEED_STRIDE, OpenAIServer
from core import embedded, models
from core.rollout import Sample

ROOT = Path(__file__).resolve().parents[1]
CHAT = "cleanrlhf/tiny-chat"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_dir():
    return embedded.resolve_model(CHAT)


@pytest.fixture(scope="module")
def chat_tok(chat_dir):
    return models.load_tokenizer(chat_dir)


class Scripted:
    """Stands for the engines: answers [5, 6] to every prompt; raises ValueError for a batch holding a seed in
    `bad_seeds` (as vLLM raised on a seed past 2**64 - 1); records each call's seeds."""

    def __init__(self, bad_seeds=()):
        self.bad_seeds, self.calls = set(bad_seeds), []

    def generate(self, prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None):
        self.calls.append(list(seed))
        if self.bad_seeds & set(seed):
            raise ValueError("Overflow when unpacking long long")
        return [[Sample([5, 6], [-0.1, -0.2], "length", True)] for _ in prompts]


@contextlib.contextmanager
def server_over(engine, tok, **kw):
    server = OpenAIServer(engine, tok, "chat", max_new_tokens=4, max_context=512, **kw)
    server.start()
    try:
        yield server
    finally:
        server.close()


def post(url: str, body: dict | str, headers: dict | None = None, route: str = "chat/completions") -> httpx.Response:
    """POST `body` (a dict as JSON; a str sent as it is, JSON with its escapes kept) to `url`/`route`."""
    content = body if isinstance(body, str) else None
    with httpx.Client(trust_env=False, timeout=30) as http:
        if content is None:
            return http.post(f"{url}/{route}", json=body, headers=headers)
        return http.post(f"{url}/{route}", content=content.encode(), headers={"content-type": "application/json",
                                                                              **(headers or {})})  # fmt: skip


# (field, value, n): each one the engine refuses or takes wrongly; the message must name the field
BAD_SAMPLING = [
    ("seed", 2**70, 1), ("seed", 2**64, 1), ("seed", -(2**63) - 1, 1), ("seed", 2**64 - 1, 2), ("seed", 1.5, 1),
    ("temperature", 1e308, 1), ("temperature", 2.5, 1), ("temperature", -1, 1), ("temperature", "hot", 1),
    ("top_p", 0, 1), ("top_p", 1.5, 1), ("top_k", -2, 1), ("top_k", 2.5, 1), ("min_p", 2, 1),
    ("presence_penalty", 3, 1), ("frequency_penalty", -2.5, 1), ("repetition_penalty", 0, 1),
    ("min_tokens", -1, 1), ("top_logprobs", 21, 1), ("max_tokens", 0, 1), ("n", 0, 1),
]  # fmt: skip


@pytest.mark.parametrize("route", ["plain", "episode"])
def test_sampling_values_the_engine_refuses_are_400_naming_the_field_and_nothing_reaches_it(chat_tok, route):
    """`serve`'s routes (`/v1`) and an episode's (whose own temperature / top-p / seed are not applied) alike: each
    value outside what vLLM 0.32 takes is a 400 naming the field, the engine is never called, the server goes on; the
    edges of the ranges are served (a seed from -2**63 to 2**64 - 1 - 7919·(n - 1), temperature 2)."""
    engine = Scripted()
    with server_over(engine, chat_tok) as server:
        url = f"{server.url}/v1" if route == "plain" else server.episode_url(server.open_episode(1.0, 0))
        for name, value, n in BAD_SAMPLING:
            if route == "episode" and (name, n) == ("seed", 2):
                continue  # a seed that is not applied: only its own range matters (the episode's seeds are used)
            body = {"model": "chat", "messages": HI, "n": n, name: value}
            r = post(url, body)
            assert r.status_code == 400, (name, value, r.text)
            assert r.json()["error"]["message"].startswith(f"{name}="), (name, value, r.text)
        raw = post(url, '{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}')
        assert raw.status_code == 400 and "temperature=nan" in raw.json()["error"]["message"]
        assert engine.calls == []
        edge = (2**64 - 1 - SEED_STRIDE, -(2**63))
        for seed in edge:
            ok = post(url, {"model": "chat", "messages": HI, "n": 2 if seed > 0 else 1, "seed": seed,
                            "temperature": 2, "top_k": -1, "repetition_penalty": 1.1})  # fmt: skip
            assert ok.status_code == 200, ok.text
    if route == "plain":  # the request's own seed: choice k samples with seed + 7919·k
        assert [s for call in engine.calls for s in call] == [edge[0], edge[0] + SEED_STRIDE, edge[1]]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(chat_tok, route):
    engine = Scripted()
    with server_over(engine, chat_tok) as server:
        url = f"{server.url}/v1"
        if route == "chat/completions":
            body, where = '{"model": "chat", "messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages[0]"
        else:
            body, where = '{"model": "chat", "prompt": "1+1=\\udfff"}', "prompt"
        r = post(url, body, route=route)
        pair = post(url, '{"model": "chat", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(where), r.text
    assert "lone UTF-16 surrogate" in r.text
    assert pair.status_code == 200, pair.text  # a surrogate pair is one character (an emoji)


def test_the_engine_failing_on_one_batched_request_fails_only_that_request():
    """Three requests in one batch, one of which the engine raises on: the batch is tried request by request, the
    bad one gets the error, the other two their samples; the batcher goes on serving."""
    engine = Scripted(bad_seeds={13})
    batcher = Batcher(engine, open_episodes=lambda: 3)
    try:
        futures = [batcher.submit([1, 2], 4, 1.0, 1.0, s) for s in (1, 13, 2)]
        results = [f.exception(timeout=10) or f.result() for f in futures]
        after = batcher.submit([1, 2], 4, 1.0, 1.0, 3).result(timeout=10)
    finally:
        batcher.stop()
    assert isinstance(results[1], ValueError) and "Overflow" in str(results[1])
    assert results[0].token_ids == results[2].token_ids == after.token_ids == [5, 6]
    assert engine.calls == [[1, 13, 2], [1], [13], [2], [3]] and batcher.failures == 1


def test_a_request_the_engine_fails_on_is_a_500_and_the_server_goes_on(chat_tok):
    engine = Scripted(bad_seeds={13})
    with server_over(engine, chat_tok) as server:
        url = f"{server.url}/v1"
        bad = post(url, {"model": "chat", "messages": HI, "seed": 13})
        good = post(url, {"model": "chat", "messages": HI, "seed": 14})
        failures, error = server.engine_failures
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert "the engine failed on this request" in bad.json()["error"]["message"] and "Overflow" in bad.text
    assert good.status_code == 200 and failures == 1 and isinstance(error, ValueError)


def test_a_body_that_is_not_json_is_415(chat_tok):
    """A web page may POST `text/plain` or a form to any address without asking first (no CORS preflight): such a
    body is refused before it is parsed, whatever it holds."""
    engine = Scripted()
    body = '{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    with server_over(engine, chat_tok) as server, httpx.Client(trust_env=False, timeout=30) as http:
        url = f"{server.url}/v1/chat/completions"
        answers = {kind: http.post(url, content=body.encode(), headers={"content-type": kind} if kind else {})
                   for kind in ("text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=utf-8")}  # fmt: skip
        eid = server.open_episode(1.0, 0)
        episode = http.post(f"{server.episode_url(eid)}/completions", content=b'{"model": "chat", "prompt": "1+1="}',
                            headers={"content-type": "text/plain;charset=UTF-8"})  # fmt: skip
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        assert answers[kind].status_code == 415, (kind, answers[kind].text)
        assert "send it as application/json" in answers[kind].json()["error"]["message"]
    assert answers["application/json; charset=utf-8"].status_code == 200
    assert episode.status_code == 415 and len(engine.calls) == 1


def test_a_server_with_a_key_answers_only_requests_that_carry_it(chat_tok):
    with server_over(Scripted(), chat_tok, api_key="s3cret") as server, httpx.Client(trust_env=False) as http:
        url = f"{server.url}/v1"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for r in (http.get(f"{url}/models", headers=headers),
                      http.post(f"{url}/chat/completions", json={"model": "chat", "messages": HI}, headers=headers)):  # fmt: skip
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
                assert r.headers["www-authenticate"] == "Bearer"
        client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="chat", messages=HI).choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="other", max_retries=0).models.list()
    with pytest.raises(ValueError, match="empty key"):
        OpenAIServer(Scripted(), chat_tok, "chat", 4, 512, api_key=" ")


def test_the_start_line_names_the_address_really_listened_on():
    """`listen_url` of a socket bound to every interface (not listening: nothing is served beyond loopback here)."""
    from agents.serve import listen_url

    class Bound:
        def __init__(self, host, port):
            self.address = (host, port)

        def getsockname(self):
            return self.address

    assert listen_url(Bound("0.0.0.0", 8000)) == ("http://0.0.0.0:8000", "every interface of this machine; here: "
                                                                        "http://127.0.0.1:8000")  # fmt: skip
    assert listen_url(Bound("::", 8000))[0] == "http://[::]:8000"
    assert listen_url(Bound("127.0.0.1", 8001)) == ("http://127.0.0.1:8001", "this machine only")
    assert listen_url(Bound("10.1.2.3", 80)) == ("http://10.1.2.3:80", "other machines too")


# ------------------------------------------------------------------------------- the real in-process engine
@pytest.fixture(scope="module")
def engines(chat_dir, one_thread):
    yield from in_process_engines(chat_dir, "float32")


BAD_SEED_AGENT = """
async def agent(client, example):
    if example["label"] == "bad":  # the server's own route, which samples as the request asks
        plain = client.with_options(base_url=str(client.base_url).split("/episodes/")[0] + "/v1")
        await plain.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], seed=2**70,
                                            n=2)
    out = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0
"""


def test_a_seed_the_engine_refuses_fails_one_episode_of_a_run_and_the_run_goes_on(engines, chat_tok, tmp_path):
    """An agent of a training run sends `seed: 2**70` (vLLM 0.32's in-process engine raised `Overflow when unpacking
    long long` and then spun on the half-added request: every later call of the run hung until the agent timeout):
    that episode fails as a bad request, the others train, and the next step runs on the same engine."""
    path = tmp_path / "bad_seed_agent.py"
    path.write_text(BAD_SEED_AGENT)
    ex = OpenAIAgentExecutor(engines, chat_tok, str(path), CHAT, 4, 128, timeout_s=120)
    rows = [{"prompt": "hi", "prompt_ids": chat_tok.encode("hi"), "label": k} for k in ("ok", "bad", "ok")]
    try:
        first = ex.run(rows, n=1, seed=0, step=1)
        second = ex.run(rows[:1], n=1, seed=1, step=2)
    finally:
        ex.close()
    assert [e.finish_reason for e in first.episodes][1] == "agent_bad_request"
    assert first.rewards.tolist() == [1.0, 0.0, 1.0] and first.logs["rollout/agent_errors"] == 1
    assert second.rewards.tolist() == [1.0]


# ----------------------------------------------------------------------------- `python -m agents.openai_server`
def run_serve(*flags: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agents.openai_server", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert needle in out.stderr, out.stderr[-3000:]


def test_a_host_other_machines_reach_is_refused_without_a_key(chat_dir, tmp_path):
    """Refused before anything is bound or loaded (so nothing here listens beyond loopback); an empty key too."""
    env = {"CLEANRLHF_API_KEY": ""}
    for host in ("0.0.0.0", "::", "example.org"):
        out = run_serve("--model", chat_dir, "--host", host, "--log-dir", str(tmp_path), env=env)
        one_line_error(out, f"--host {host}: other machines can reach it, and no key is set: give --api-key KEY")
    out = run_serve("--model", chat_dir, "--host", "0.0.0.0", "--api-key", "", "--log-dir", str(tmp_path), env=env)
    one_line_error(out, "--api-key '': an empty key would let anyone in")
    assert list(tmp_path.iterdir()) == []  # no log left behind by a refused command


def test_a_port_out_of_range_a_context_beyond_the_models_and_a_damaged_weights_file_are_named(chat_dir, tmp_path):
    one_line_error(run_serve("--model", chat_dir, "--port", "99999"), "--port 99999: must be from 0 to 65535")
    out = subprocess.run([sys.executable, "-m", "agents.serve", "--model", chat_dir, "--port", "99999"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # the module itself runs the same command
    one_line_error(out, "--port 99999: must be from 0 to 65535")
    longest = models.max_positions(chat_dir)
    out = subprocess.run([sys.executable, "-m", "agents.openai_server", "--model", chat_dir, "--port", "0",
                          "--max-context", str(longest + 1), "--log-dir", "logs"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    one_line_error(out, f"--max-context {longest + 1}: the model {chat_dir} holds {longest} tokens")
    assert not (tmp_path / "logs").exists()  # the log of a refused command, holding nothing, is removed
    broken = tmp_path / "broken"
    shutil.copytree(chat_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = run_serve("--model", str(broken), "--port", "0", "--log-dir", str(tmp_path))
    one_line_error(out, f"--model {broken}: damaged weights file {weights}")


@contextlib.contextmanager
def served(log: Path, *flags: str, env: dict | None = None, timeout_s: float = 180.0):
    """`python -m agents.openai_server` on tiny-chat at a free loopback port; yields (process, base URL)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agents.openai_server", "--model", CHAT, "--port", "0",
                                 "--log-dir", str(log.parent), *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})  # fmt: skip
    try:
        deadline, url = time.monotonic() + timeout_s, None
        while url is None:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-3000:]}"
            m = re.search(r" at (http://\S+/v1) ", log.read_text())
            url = m.group(1) if m else None
            time.sleep(0.2)
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
def test_serve_refuses_what_the_engine_cannot_take_checks_the_key_and_keeps_its_console_clean(tmp_path):
    """The command as a user runs it, with the key from the environment: the requests that made it exit (seed 2**70,
    n=2 with seed 2**64 - 1, temperature 1e308) are 400s naming the field and it goes on serving; no key or a text
    body is refused; the start line names the address and the key; vLLM's warnings are in the log file, not on the
    console; SIGTERM stops it with exit 0."""
    console = tmp_path / "console.txt"
    with served(console, env={"CLEANRLHF_API_KEY": "k3y"}) as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="k3y", max_retries=0)
        for field, kw in (("seed", {"seed": 2**70}), ("seed", {"seed": 2**64 - 1, "n": 2}),
                          ("temperature", {"temperature": 1e308})):  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=f"{field}="):
                client.chat.completions.create(model=CHAT, messages=HI, max_tokens=4, **kw)
        out = client.chat.completions.create(model=CHAT, messages=HI, max_tokens=4, seed=2**64 - 1, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="none", max_retries=0).models.list()
        plain = httpx.post(f"{url}/chat/completions", content=b'{"model": "policy", "messages": []}', trust_env=False,
                           headers={"content-type": "text/plain", "authorization": "Bearer k3y"})  # fmt: skip
        assert plain.status_code == 415
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = console.read_text()
    port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", text).group(1)
    assert f"at http://127.0.0.1:{port}/v1 (this machine only; requests need the key" in text
    logged = Path(re.search(r"library messages: (\S+) \(--verbose shows them here\)", text).group(1))
    assert "WARNING" not in text and "Traceback" not in text, text
    assert logged.parent == tmp_path and "WARNING" in logged.read_text()  # vLLM's, e.g. libtcmalloc not found
    assert text.rstrip().endswith("stopped")
