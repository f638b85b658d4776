"""Tests for rewards/server.py over loopback (127.0.0.1 only): the served scores equal in-process scores, normalization
uses the statistics saved in config.json, malformed requests get a 4xx with a message, and the server keeps serving.

The server runs in a thread of this process (uvicorn.Server) on a free port, is waited for with a bounded timeout and
is always shut down. The reward model is the embedded tiny body with a seeded scalar head (no training needed).
The bounded-work tests (time limit, a client that gives up, SIGTERM) start the real `python -m rewards.server` process.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import torch
import tyro
from transformers import AutoModelForSequenceClassification

from core import data, models
from core.engine import free_port
from rewards.server import RewardScorer, ServerArgs, check_server_args, create_app, load_scorers
from rewards.server import main as server_main

TEXTS = ["1+2=3", "1+2=4", "37+45=82", "37+45=28", "99+99=198", "", "5+5=10 and more"]
MEAN, STD = 0.25, 2.0
TIMEOUT = 30


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def export_rm(tiny_path, path, seed, mean, std):
    """A reward-model folder as algos/rm.py exports it: tiny body + scalar head, reward_mean/std in config.json."""
    torch.manual_seed(seed)
    model = models.load_scalar_model(str(tiny_path), "fp32")
    model.config.reward_mean, model.config.reward_std = mean, std
    model.save_pretrained(path)
    models.load_tokenizer(str(tiny_path)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_path(tiny_path, tmp_path_factory):
    return export_rm(tiny_path, tmp_path_factory.mktemp("rm"), 0, MEAN, STD)


@contextmanager
def serve(app):
    """`app` served by uvicorn in a thread on a free loopback port: its URL once it answers; always shut down."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not srv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "reward server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def server(rm_path):
    scorer = RewardScorer(rm_path, batch_size=3, max_len=64)  # batch 3 < 7 texts: chunking is exercised
    with serve(create_app(scorer, max_texts=16)) as url:
        yield url


def in_process_scores(rm_path, texts):
    """Reference scores: HF's own sequence-classification forward, one text at a time (no padding involved)."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    tokenizer = models.load_tokenizer(rm_path)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([data.reward_ids(tokenizer, t)])).logits.item() for t in texts]


def post(url, body, **kw):
    return requests.post(f"{url}/get_reward", timeout=TIMEOUT, **({"json": body} if body is not None else kw))


def test_served_scores_equal_in_process_scores(server, rm_path):
    r = post(server, {"query": TEXTS, "prompts": [t[:3] for t in TEXTS], "labels": ["x"] * len(TEXTS)})
    assert r.status_code == 200, r.text
    body = r.json()
    want = in_process_scores(rm_path, TEXTS)
    assert body["rewards"] == pytest.approx(want, abs=1e-5) and body["scores"] == body["rewards"]
    assert len(set(round(x, 6) for x in want)) == len(TEXTS)  # the texts really get different scores
    # order and batching do not matter: one text at a time gives the same numbers
    singles = [post(server, {"query": [t]}).json()["rewards"][0] for t in TEXTS[::-1]]
    assert singles[::-1] == pytest.approx(want, abs=1e-5)
    assert requests.get(f"{server}/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert post(server, {"query": []}).json() == {"rewards": [], "scores": []}


def test_normalization_uses_saved_statistics(rm_path):
    raw = RewardScorer(rm_path)(TEXTS)
    normalized = RewardScorer(rm_path, normalize=True)(TEXTS)
    assert normalized == pytest.approx([(r - MEAN) / STD for r in raw], abs=1e-6)


def test_normalize_without_statistics_is_a_clear_error(tiny_path, tmp_path):
    model = models.load_scalar_model(str(tiny_path), "fp32")
    model.save_pretrained(tmp_path)
    models.load_tokenizer(str(tiny_path)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="reward_mean"):
        RewardScorer(str(tmp_path), normalize=True)


@pytest.mark.parametrize(
    "kwargs,status,needle",
    [
        ({"data": "this is not json", "headers": {"Content-Type": "application/json"}}, 422, "JSON"),
        ({"json": {"prompts": ["1+2="]}}, 422, "query"),  # no query
        ({"json": {"query": "1+2=3"}}, 422, "list"),  # a string, not a list
        ({"json": {"query": [1, 2]}}, 422, "string"),  # not texts
        ({"json": {"query": ["1+2=3", "2+2=4"], "prompts": ["1+2="]}}, 400, "'prompts' has 1 entries"),
        ({"json": {"query": ["1+2=3"], "labels": ["3", "4"]}}, 400, "'labels' has 2 entries"),
        ({"json": {"query": ["1+2=3", "9" * 100]}}, 400, "query[1]: 102 tokens > max_len 64"),
        ({"json": {"query": ["1+1=2"] * 17}}, 400, "max_texts 16"),
    ],
)
def test_malformed_request_gets_4xx_with_message_and_server_keeps_serving(server, rm_path, kwargs, status, needle):
    r = requests.post(f"{server}/get_reward", timeout=TIMEOUT, **kwargs)
    assert r.status_code == status, r.text
    assert needle in r.text
    good = post(server, {"query": TEXTS[:2]})
    assert good.status_code == 200 and good.json()["rewards"] == pytest.approx(in_process_scores(rm_path, TEXTS[:2]),
                                                                                abs=1e-5)  # fmt: skip


def test_wrong_method_and_path(server):
    assert requests.get(f"{server}/get_reward", timeout=TIMEOUT).status_code == 405
    assert requests.post(f"{server}/nope", json={"query": ["x"]}, timeout=TIMEOUT).status_code == 404


def test_a_fault_of_the_server_while_scoring_gets_5xx_not_4xx(server, monkeypatch, rm_path):
    """A ValueError raised inside the model's forward is the server's fault, not the client's: 500 naming it (the
    client retries a 5xx), and the server keeps serving."""

    def broken(*args, **kwargs):
        raise ValueError("the forward failed")

    with monkeypatch.context() as m:
        m.setattr(models, "sequence_scores", broken)
        r = post(server, {"query": TEXTS[:2]})
    assert r.status_code == 500, r.text
    assert "the reward server failed while scoring: ValueError: the forward failed" in r.text
    good = post(server, {"query": TEXTS[:2]})
    assert good.status_code == 200 and good.json()["rewards"] == pytest.approx(in_process_scores(rm_path, TEXTS[:2]),
                                                                                abs=1e-5)  # fmt: skip


@pytest.mark.parametrize("flags, message", [
    ({"batch_size": 0}, "--batch-size 0: must be > 0"),
    ({"max_len": 0}, "--max-len 0: must be > 0"),
    ({"max_texts": 0}, "--max-texts 0: must be > 0"),
    ({"port": 99999}, "--port 99999: must be a TCP port, 1 to 65535"),
    ({"port": 0}, "--port 0: must be a TCP port, 1 to 65535"),
    ({"request_timeout_s": -1.0}, "--request-timeout-s -1.0: must be a finite number of seconds >= 0 (0: no limit)"),
    ({"dtype": "fp64"}, "--dtype fp64: must be one of auto, bf16, fp32"),
])  # fmt: skip
def test_the_servers_own_flags_are_checked_before_the_model_loads(monkeypatch, flags, message):
    """Each of these once started a server that answered every request 400 (or died with a bare KeyError)."""
    monkeypatch.setattr(models, "load_scalar_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError) as err:
        server_main(ServerArgs(model="/no/such/model", **flags))
    assert str(err.value) == message


def test_the_server_command_lists_every_bad_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rewards.server", "--model", str(tmp_path / "nothing-here"),
                          "--batch-size", "0", "--dtype", "fp64"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert (
        "invalid flags:\n  --batch-size 0: must be > 0\n  --dtype fp64: must be one of auto, bf16, fp32" in out.stderr
    )


# ------------------------------------------------------------------------------ the RL scripts' client side
def test_remote_reward_client_matches_server_and_splits_across_urls(server, rm_path):
    from rewards.remote import ModelReward, RemoteReward

    ref = torch.tensor(in_process_scores(rm_path, TEXTS))
    prompts, labels = [t[:3] for t in TEXTS], [None] * len(TEXTS)
    one = RemoteReward([server], timeout_s=TIMEOUT)(TEXTS, prompts, labels)
    two = RemoteReward([server, server + "/get_reward"], timeout_s=TIMEOUT)(TEXTS, prompts, labels)  # 2 chunks
    local = ModelReward(rm_path)(TEXTS, prompts, labels)
    for out in (one, two, local):
        torch.testing.assert_close(out["rewards"], ref, rtol=0, atol=1e-4)


def test_remote_reward_retries_then_names_the_url():
    from rewards.remote import RemoteReward

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{dead}/get_reward failed after 2 attempt\(s\)"):
        RemoteReward([dead], timeout_s=2, retries=1)(["1+1=2"], ["1+1="], [None])
    assert time.monotonic() - t0 >= 1.0  # it waited before retrying


def test_remote_reward_does_not_retry_a_client_error(server):
    from rewards.remote import RemoteReward

    with pytest.raises(RuntimeError, match="failed after 1 attempt.*HTTP 400.*max_len"):
        RemoteReward([server], timeout_s=TIMEOUT, retries=3)(["9" * 500], ["p"], [None])  # over-long text: 400


def test_rl_scripts_take_one_reward_source(rm_path, tmp_path):
    from rewards.loader import RewardConfig, load_reward_func

    with pytest.raises(ValueError, match="--reward.func and --reward.model: give one reward source"):
        load_reward_func(RewardConfig(func=str(tmp_path / "r.py"), model=rm_path))
    func, name = load_reward_func(RewardConfig(model=rm_path))
    assert name == rm_path and func(["1+2=3"], ["1+2="], [None])["rewards"].shape == (1,)


# ------------------------------------------------------------------ named components: algos/gdpo.py's reward parts
MEAN_B, STD_B = -1.0, 0.5


@pytest.fixture(scope="module")
def rm_path_b(tiny_path, tmp_path_factory):
    """A second reward model: another seeded head, other saved statistics."""
    return export_rm(tiny_path, tmp_path_factory.mktemp("rm_b"), 1, MEAN_B, STD_B)


@pytest.fixture(scope="module")
def scorers(rm_path, rm_path_b):
    """One scorer per model, with the `server` fixture's sizes: the same batches, so bit-for-bit the same numbers."""
    return {"correct": RewardScorer(rm_path, batch_size=3, max_len=64),
            "style": RewardScorer(rm_path_b, batch_size=3, max_len=64)}  # fmt: skip


@pytest.fixture(scope="module")
def parts_server(scorers):
    """`--components correct=<rm> style=<rm_b>` without `--model`: the rewards are the parts' sum."""
    with serve(create_app(None, max_texts=16, components=scorers)) as url:
        yield url


def test_components_are_each_models_own_scores_and_the_rewards_their_sum(parts_server, server, scorers, rm_path,
                                                                          rm_path_b):  # fmt: skip
    body = post(parts_server, {"query": TEXTS}).json()
    assert list(body) == ["rewards", "scores", "components"] and list(body["components"]) == ["correct", "style"]
    correct, style = body["components"]["correct"], body["components"]["style"]
    assert correct == post(server, {"query": TEXTS}).json()["rewards"]  # the one-model server's answer, exactly
    assert correct == scorers["correct"](TEXTS) and style == scorers["style"](TEXTS)
    assert all(a != b for a, b in zip(correct, style))  # two models: a swapped or repeated part would show
    assert body["rewards"] == [a + b for a, b in zip(correct, style)] and body["scores"] == body["rewards"]
    assert requests.get(f"{parts_server}/health", timeout=TIMEOUT).json() == {
        "status": "ok", "model": None, "normalize": False, "components": {"correct": rm_path, "style": rm_path_b}}  # fmt: skip
    assert post(parts_server, {"query": []}).json() == {"rewards": [], "scores": [],
                                                        "components": {"correct": [], "style": []}}  # fmt: skip
    r = post(parts_server, {"query": ["1+2=3", "9" * 100]})  # over-long: the answer names the part's model
    assert r.status_code == 400 and f"component 'correct' ({rm_path}): query[1]: 102 tokens > max_len 64" in r.text


def test_with_model_too_the_rewards_are_its_scores_and_a_model_served_twice_scores_once(scorers, monkeypatch):
    """`--model <rm_b> --components correct=<rm> style=<rm_b>`: rewards = rm_b's scores (not the sum); rm_b, named
    twice, runs its forwards once: 7 texts in batches of 3 are 3 forwards per model, 6 in all."""
    forwards, forward = [], models.sequence_scores
    monkeypatch.setattr(models, "sequence_scores", lambda *a, **k: forwards.append(1) or forward(*a, **k))
    app = create_app(scorers["style"], max_texts=16, components=scorers)
    with serve(app) as url:
        body = post(url, {"query": TEXTS}).json()
        health = requests.get(f"{url}/health", timeout=TIMEOUT).json()
    assert len(forwards) == 6
    assert body["components"] == {"correct": scorers["correct"](TEXTS), "style": scorers["style"](TEXTS)}
    assert body["rewards"] == body["scores"] == body["components"]["style"]
    assert health["model"] == scorers["style"].path and list(health["components"]) == ["correct", "style"]


def test_the_flags_load_each_part_normalized_by_its_own_statistics(rm_path, rm_path_b, scorers):
    args = tyro.cli(ServerArgs, args=["--components", f"correct={rm_path}", f"style={rm_path_b}", f"again={rm_path}",
                                      "--normalize", "--batch-size", "3", "--max-len", "64"])  # fmt: skip
    check_server_args(args)
    model, parts = load_scorers(args)
    assert model is None and list(parts) == ["correct", "style", "again"] and parts["again"] is parts["correct"]
    assert parts["correct"](TEXTS) == pytest.approx([(r - MEAN) / STD for r in scorers["correct"](TEXTS)], abs=1e-6)
    assert parts["style"](TEXTS) == pytest.approx([(r - MEAN_B) / STD_B for r in scorers["style"](TEXTS)], abs=1e-6)
    model, parts = load_scorers(tyro.cli(ServerArgs, args=["--model", rm_path, "--components", f"correct={rm_path}"]))
    assert parts["correct"] is model and not model.normalize
    assert tyro.cli(ServerArgs, args=["--model", rm_path]) == ServerArgs(model=rm_path)  # --model alone: as before


def test_the_rl_scripts_client_receives_the_components(parts_server):
    """rewards/remote.py's client, one URL and two (the batch split in two, the parts joined in order), and the
    reward contract's check of the parts that algos/gdpo.py's rollout runs."""
    from rewards.loader import components
    from rewards.remote import RemoteReward

    direct = post(parts_server, {"query": TEXTS}).json()
    prompts, labels = [t[:3] for t in TEXTS], [None] * len(TEXTS)
    out = RemoteReward([parts_server], timeout_s=TIMEOUT)(TEXTS, prompts, labels)
    assert out["components"] == direct["components"]
    torch.testing.assert_close(out["rewards"], torch.tensor(direct["rewards"]), rtol=0, atol=0)
    checked = components(out, f"reward server {parts_server}", 0, len(TEXTS))
    assert list(checked) == ["correct", "style"]
    for name, values in checked.items():
        torch.testing.assert_close(values, torch.tensor(direct["components"][name]), rtol=0, atol=0)
    two = RemoteReward([parts_server, parts_server + "/get_reward"], timeout_s=TIMEOUT)(TEXTS, prompts, labels)
    assert list(two["components"]) == ["correct", "style"]
    for name, values in direct["components"].items():  # other batches, other padding: equal up to float error
        assert two["components"][name] == pytest.approx(values, abs=1e-5)


@pytest.mark.parametrize("flags, message", [
    ({"components": ("correct",)}, "--components correct: expected NAME=PATH, e.g. correct=runs/rm_a/hf"),
    ({"components": ("=runs/a",)}, "--components =runs/a: the name before '=' is empty"),
    ({"components": ("my-part=runs/a",)}, "--components my-part=runs/a: the name 'my-part' is not an identifier "
                                          "(letters, digits and _, not starting with a digit)"),
    ({"components": ("2nd=runs/a",)}, "--components 2nd=runs/a: the name '2nd' is not an identifier (letters, digits "
                                      "and _, not starting with a digit)"),
    ({"components": ("correct=",)}, "--components correct=: the path after '=' is empty"),
    ({"components": ("correct=runs/a", "correct=runs/b"), "model": "runs/m"},
     "--components correct=runs/b: the name 'correct' is given twice; each part needs its own name"),
    ({}, "--model / --components: no reward model to serve: give --model PATH, --components NAME=PATH ..., or both"),
])  # fmt: skip
def test_component_flags_are_refused_before_any_model_loads(monkeypatch, flags, message):
    monkeypatch.setattr(models, "load_scalar_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError) as err:
        server_main(ServerArgs(**flags))
    assert str(err.value) == message


def test_the_command_line_lists_every_bad_component(monkeypatch):
    monkeypatch.setattr(models, "load_scalar_model", lambda *a, **k: pytest.fail("a model was loaded"))
    args = tyro.cli(ServerArgs, args=["--components", "a", "b=x", "b=y", "--batch-size", "0"])
    with pytest.raises(ValueError) as err:
        server_main(args)
    assert str(err.value) == ("invalid flags:\n  --components a: expected NAME=PATH, e.g. correct=runs/rm_a/hf\n  "
                              "--components b=y: the name 'b' is given twice; each part needs its own name\n  "
                              "--batch-size 0: must be > 0")  # fmt: skip


# ------------------------------------------------------------------ bounded work: the real server process
SLOW = ["1" * 500] * 1500  # with --batch-size 1: 1500 forwards of 502 tokens, ~45 s on one CPU core: far past 4 s
ROOT = Path(__file__).resolve().parents[1]


def start_server(rm_path, log_path, *flags):
    """`python -m rewards.server` on a free port; (process, url) once /health answers."""
    port = free_port()
    with open(log_path, "w") as log:  # the server writes to its own copy of the file descriptor
        proc = subprocess.Popen([sys.executable, "-m", "rewards.server", "--model", rm_path, "--port", str(port),
                                 *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"reward server exited: {open(log_path).read()[-3000:]}"
        assert time.monotonic() < deadline, "reward server did not start"
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.2)


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def bounded_server(rm_path, tmp_path_factory):
    """The server process, one forward per text, each request limited to 4 s."""
    proc, url = start_server(rm_path, tmp_path_factory.mktemp("srv") / "server.log", "--batch-size", "1",
                             "--request-timeout-s", "4", "--max-texts", "100000")  # fmt: skip
    try:
        yield url
    finally:
        stop(proc)


def timed_post(url, texts, timeout=TIMEOUT):
    t0 = time.monotonic()
    r = requests.post(f"{url}/get_reward", json={"query": texts}, timeout=timeout)
    return r, time.monotonic() - t0


def test_a_client_that_gives_up_does_not_delay_the_next_request(bounded_server):
    """The server stops scoring a request whose client disconnected, instead of finishing it ahead of the retry.
    The client waits 1.5 s (tokenizing SLOW takes ~0.6 s, then the model is busy); the abandoned request's own 4 s
    limit alone would hold the model 2.5 s more."""
    with pytest.raises(requests.ReadTimeout):
        requests.post(f"{bounded_server}/get_reward", json={"query": SLOW}, timeout=1.5)
    r, took = timed_post(bounded_server, TEXTS[:2])
    assert r.status_code == 200, r.text
    assert took < 1.5, f"the next request waited {took:.1f} s behind the abandoned one"


def test_a_request_over_its_time_limit_gets_504_and_frees_the_model(bounded_server):
    r, took = timed_post(bounded_server, SLOW)
    assert r.status_code == 504, r.text[:300]
    assert "--request-timeout-s 4 s" in r.text and 3.5 < took < 8
    r, took = timed_post(bounded_server, TEXTS[:2])
    assert r.status_code == 200 and took < 3, (r.text, took)


def test_a_text_longer_than_the_model_positions_gets_400(bounded_server, rm_path):
    """--max-len is 2048 by default, but the tiny model has 512 positions."""
    assert models.load_scalar_model(rm_path, "fp32").config.max_position_embeddings == 512
    r, _ = timed_post(bounded_server, ["1+1=2", "9" * 600])
    assert r.status_code == 400, r.text[:300]
    assert "query[1]: 602 tokens > max_len 512 (the model's max_position_embeddings; --max-len is 2048)" in r.text
    assert timed_post(bounded_server, ["9" * 509])[0].status_code == 200  # 510 tokens + eos: fits


def test_remote_reward_retries_a_timeout_and_a_504_then_names_the_url(bounded_server):
    """The RL scripts' client against both limits: its own timeout and the server's (504 with the server's message),
    each retried, then an error naming the URL; afterwards the model is free for the next batch."""
    from rewards.remote import RemoteReward

    url, n = f"{bounded_server}/get_reward", len(SLOW)
    with pytest.raises(RuntimeError, match=rf"{url} failed after 2 attempt\(s\): (Read)?Timeout"):
        RemoteReward([bounded_server], timeout_s=1.5, retries=1)(SLOW, SLOW, [None] * n)
    r, took = timed_post(bounded_server, TEXTS[:2])
    assert r.status_code == 200 and took < 2, (r.text, took)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{url} failed after 2 attempt\(s\): HTTP 504: .*--request-timeout-s 4 s"):
        RemoteReward([bounded_server], timeout_s=TIMEOUT, retries=1)(SLOW, SLOW, [None] * n)
    assert time.monotonic() - t0 < 15  # two attempts of at most 4 s each and a 1 s pause
    assert RemoteReward([bounded_server], timeout_s=3, retries=0)(TEXTS, TEXTS, [None] * 7)["rewards"].shape == (7,)


def test_sigterm_stops_a_busy_server_within_seconds(rm_path, tmp_path):
    proc, url = start_server(rm_path, tmp_path / "server.log", "--batch-size", "1")
    try:
        answer = {}
        client = threading.Thread(target=lambda: answer.update(r=timed_post(url, SLOW)[0]), daemon=True)
        client.start()
        time.sleep(1.5)  # the request is computing
        assert client.is_alive()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        took = time.monotonic() - t0
        client.join(timeout=5)
        assert took < 5, f"the server took {took:.1f} s to stop"
        assert answer["r"].status_code == 503 and "shutting down" in answer["r"].text
    finally:
        stop(proc)


# ------------------------------------------------------------------ keys, binds and content types
@pytest.fixture(scope="module")
def keyed_server(rm_path):
    """The app with a key, in a thread on 127.0.0.1."""
    with serve(create_app(RewardScorer(rm_path, batch_size=3, max_len=64), api_key="s3cret")) as url:
        yield url


def test_a_server_with_a_key_answers_only_requests_that_carry_it(keyed_server, rm_path, monkeypatch):
    from rewards.remote import RemoteReward

    body = {"query": TEXTS[:2]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic x"}):
        r = requests.post(f"{keyed_server}/get_reward", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401 and "Authorization: Bearer KEY" in r.text, (headers, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(f"{keyed_server}/health", timeout=TIMEOUT).status_code == 401
    r = requests.post(f"{keyed_server}/get_reward", json=body, headers={"Authorization": "Bearer s3cret"},
                      timeout=TIMEOUT)  # fmt: skip
    assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(
        in_process_scores(rm_path, TEXTS[:2]), abs=1e-5
    )
    monkeypatch.delenv("CLEANRLHF_API_KEY", raising=False)  # the RL scripts' client: no key, then the key
    with pytest.raises(RuntimeError, match=r"failed after 1 attempt\(s\): HTTP 401: .*\(no key was sent; the key is "
                                           r"read from the environment variable named by --reward.api-key-env"):  # fmt: skip
        RemoteReward([keyed_server], timeout_s=TIMEOUT, retries=2)(TEXTS[:2], TEXTS[:2], [None] * 2)
    monkeypatch.setenv("CLEANRLHF_API_KEY", "s3cret")
    out = RemoteReward([keyed_server], timeout_s=TIMEOUT)(TEXTS[:2], TEXTS[:2], [None] * 2)
    assert out["rewards"].tolist() == pytest.approx(r.json()["rewards"], abs=1e-5)


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                                     {"Content-Type": "multipart/form-data; boundary=x"}, {}])  # fmt: skip
def test_a_body_that_is_not_json_gets_415(server, headers):
    """What a web page may POST across origins without asking first ("simple" requests) was parsed as JSON."""
    r = requests.post(f"{server}/get_reward", data=b'{"query": ["1+2=3"]}', headers=headers, timeout=TIMEOUT)
    assert r.status_code == 415 and "send application/json" in r.text, r.text
    ok = requests.post(f"{server}/get_reward", data=b'{"query": ["1+2=3"]}', timeout=TIMEOUT,
                       headers={"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_a_bind_other_machines_reach_needs_a_key_or_no_auth(monkeypatch):
    """Checked with the other flags, before the model loads and before anything binds."""
    monkeypatch.setattr(models, "load_scalar_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.delenv("CLEANRLHF_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.7", "myhost.example"):
        with pytest.raises(ValueError) as err:
            server_main(ServerArgs(model="/no/such/model", host=host))
        assert str(err.value) == (f"--host {host}: other machines can reach it, and no key is set: give --api-key KEY "
                                  "(or set CLEANRLHF_API_KEY), or --no-auth to serve anyone who can reach the port")  # fmt: skip
    with pytest.raises(ValueError, match=r"^--api-key '': an empty key would let anyone in"):
        server_main(ServerArgs(model="/no/such/model", api_key=""))
    from rewards.server import check_server_args, server_key

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_server_args(ServerArgs(model="m", host=host))
    check_server_args(ServerArgs(model="m", host="0.0.0.0", no_auth=True))
    check_server_args(ServerArgs(model="m", host="0.0.0.0", api_key="k"))
    monkeypatch.setenv("CLEANRLHF_API_KEY", "from-env")
    check_server_args(ServerArgs(model="m", host="0.0.0.0"))
    assert server_key(ServerArgs(model="m")) == "from-env" and server_key(ServerArgs(model="m", api_key="k")) == "k"


def test_the_start_line_names_the_address_it_really_listens_on():
    from rewards.server import bind, start_line

    port = free_port()
    sock = bind("localhost", port)
    try:
        assert start_line(sock, None) == (f"reward server listening on http://127.0.0.1:{port} (this machine only; no "
                                          f"key: anyone who can reach it); POST http://127.0.0.1:{port}/get_reward")  # fmt: skip
        assert "requests need the key" in start_line(sock, "k")
        sock.listen()  # a server on the port: a second one cannot have it, and says so naming the flags
        with pytest.raises(ValueError, match=rf"^--host 127.0.0.1 --port {port}: cannot listen there: "):
            bind("127.0.0.1", port)
    finally:
        sock.close()


def test_the_server_process_prints_its_address_and_checks_the_key(rm_path, tmp_path, monkeypatch):
    """`python -m rewards.server` with the key in CLEANRLHF_API_KEY (not on the command line): the start line names
    the address and that a key is needed; the RL scripts' client gets in with the key and not without."""
    from rewards.remote import RemoteReward

    port, log_path = free_port(), tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLEANRLHF_API_KEY": "s3cret"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rewards.server", "--model", rm_path, "--port", str(port)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"reward server exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "reward server did not start"
            try:
                if requests.get(f"{url}/health", headers={"Authorization": "Bearer s3cret"}, timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        assert (f"reward server listening on {url} (this machine only; requests need the key (Authorization: Bearer "
                "KEY)); POST") in log_path.read_text()  # fmt: skip
        assert requests.get(f"{url}/health", timeout=TIMEOUT).status_code == 401
        monkeypatch.delenv("CLEANRLHF_API_KEY", raising=False)
        with pytest.raises(RuntimeError, match="HTTP 401"):
            RemoteReward([url], timeout_s=TIMEOUT, retries=0)(TEXTS[:1], TEXTS[:1], [None])
        monkeypatch.setenv("CLEANRLHF_API_KEY", "s3cret")
        assert RemoteReward([url], timeout_s=TIMEOUT)(TEXTS[:1], TEXTS[:1], [None])["rewards"].shape == (1,)
    finally:
        stop(proc)
