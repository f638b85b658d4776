"""Tests for rewards/server.py over loopback (127.0.0.1 only): the served scores equal in-process scores, normalization
uses the statistics saved in config.json, malformed requests get a 4xx with a message, and the server keeps serving.

The server runs in a thread of this process (uvicorn.Server) on a free port, is waited for with a bounded timeout and
is always shut down. The reward model is the embedded tiny body with a seeded scalar head (no training needed).
"""

import threading
import time

import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification

from core import data, models
from core.engine import free_port
from rewards.server import RewardScorer, create_app

TEXTS = ["1+2=3", "1+2=4", "37+45=82", "37+45=28", "99+99=198", "", "5+5=10 and more"]
MEAN, STD = 0.25, 2.0
TIMEOUT = 30


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def rm_path(tiny_path, tmp_path_factory):
    """A reward-model folder as algos/rm.py exports it: tiny body + scalar head, reward_mean/std in config.json."""
    torch.manual_seed(0)
    model = models.load_scalar_model(str(tiny_path), "fp32")
    model.config.reward_mean, model.config.reward_std = MEAN, STD
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    models.load_tokenizer(str(tiny_path)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(rm_path):
    import uvicorn

    scorer = RewardScorer(rm_path, batch_size=3, max_len=64)  # batch 3 < 7 texts: chunking is exercised
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(scorer, max_texts=16), host="127.0.0.1", port=port,
                                        log_level="warning"))  # fmt: skip
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
