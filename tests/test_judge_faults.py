"""Faults of the judge (`--reward.judge-url`, rewards/judge.py) and of the HTTP reward client (`--reward.remote-url`,
rewards/remote.py): answers that were misread, a server that answers 200 and then trickles its body, a judge that is
dead at start, and the key sent as a Bearer token. Every stand-in server binds 127.0.0.1 on a free port."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core.engine import free_port
from rewards.judge import JudgeReward, load_prompt, parse_verdict
from rewards.loader import RewardConfig, load_reward_func, score
from rewards.remote import RemoteReward

QUERIES, PROMPTS, LABELS = ["2+2=4", "2+2=5"], ["2+2=", "2+2="], ["4", "4"]


class Stub:
    """A stand-in server for both contracts: `GET /v1/models`, `POST /v1/chat/completions` (answers `answer`, with
    `finish_reason`) and `POST /get_reward` (one 1.0 per query). `trickle_s` > 0: every POST answers 200 with its
    headers at once, then one byte of the body each `trickle_s` seconds. `key`: requests without `Bearer key` get
    401. `seen` holds each request's Authorization header."""

    def __init__(self, answer: str = "Verdict: yes", trickle_s: float = 0.0, key: str | None = None):
        self.answer, self.trickle_s, self.key, self.finish_reason = answer, trickle_s, key, "stop"
        self.seen: list[str | None] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if stub.trickle_s and self.command == "POST":
                        for i in range(len(data)):  # bounded: the whole body, a byte at a time
                            self.wfile.write(data[i : i + 1])
                            self.wfile.flush()
                            time.sleep(stub.trickle_s)
                    else:
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up
                    pass

            def _authorized(self) -> bool:
                stub.seen.append(self.headers.get("Authorization"))
                if stub.key is not None and self.headers.get("Authorization") != f"Bearer {stub.key}":
                    self._send(401, {"error": {"message": "bad key"}})
                    return False
                return True

            def do_GET(self):
                if self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                if self.path.endswith("/get_reward"):
                    return self._send(200, {"rewards": [1.0] * len(body["query"])})
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": stub.answer},
                                              "finish_reason": stub.finish_reason}]})  # fmt: skip

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    servers = []

    def make(**kw) -> Stub:
        servers.append(Stub(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Question: {prompt}\nReference: {label}\nAnswer: {response}\nEnd with the line `Verdict: yes` or "
                    "`Verdict: no`, or with `Score: x`, x from 0 to 1.")  # fmt: skip
    return str(path)


# ------------------------------------------------------------------------------------- what is read from an answer
@pytest.mark.parametrize("answer", [
    "not correct",  # read as 1.0: the verdict word "correct"
    "No, 2+2 is not 5",  # read as 2.0: the first number
    "The answer 042 is correct",  # read as 42.0
    "1e-3",  # read as 1.0
    "Score: 7",  # outside [0, 1]: read as 7.0
    "Score: 042",
    "Score: -0.5",
    "Score: 3/0",
    "Score: nan",
    "Score: 0.9 but maybe 0.1",
    "Verdict: correct",  # only yes / no
    "Verdict: yes\nOn second thought it is wrong.",  # the last line counts
    "",
])  # fmt: skip
def test_an_answer_without_a_final_line_in_range_is_refused(answer):
    """Each of these was read as a reward (the first number, else the first verdict word, anywhere in the text)."""
    with pytest.raises(ValueError):
        parse_verdict(answer)


@pytest.mark.parametrize(("answer", "reward"), [
    ("Reasoning: 2+2 is 4, not 5.\nVerdict: no", 0.0), ("Score: 1e-3", 0.001), ("Score: 0.5/1", 0.5),
    ("Step 1: 3 tokens.\nScore: 1.0", 1.0), ("  Verdict:   YES  \n\n", 1.0),
])  # fmt: skip
def test_only_the_final_line_is_read(answer, reward):
    assert parse_verdict(answer) == pytest.approx(reward)


def test_only_the_forms_the_prompt_names_are_read():
    assert parse_verdict("Score: 0.5", ("score",)) == 0.5
    with pytest.raises(ValueError, match=r"its last line 'Score: 0.5' is not `Verdict: yes` or `Verdict: no`"):
        parse_verdict("Score: 0.5", ("verdict",))


def test_a_prompt_file_that_asks_for_no_final_line_is_refused(tmp_path):
    old = tmp_path / "old.txt"
    old.write_text("Question: {prompt}\nAnswer: {response}\nIs the answer right? yes or no.")
    with pytest.raises(ValueError, match=r"--reward.judge-prompt .*old.txt: asks for no final line; only the answer's "
                                         r"last line is read, so ask for one: `Score: x` .*rewards/judge_prompt.txt"):  # fmt: skip
        load_prompt(str(old))


def test_the_shipped_example_prompt_is_valid():
    from pathlib import Path

    text = load_prompt(str(Path(__file__).resolve().parents[1] / "rewards" / "judge_prompt.txt"))
    assert "Verdict: yes" in text and "{response}" in text and "{label}" in text


def test_every_judge_reward_is_in_0_1_and_a_bad_one_names_the_query(stub, prompt_file):
    judge = stub(answer="Score: 0.7")
    fn, name = load_reward_func(RewardConfig(judge_url=judge.url + "/v1", judge_prompt=prompt_file))
    rewards, _, scores, _ = score(fn, name, QUERIES, PROMPTS, LABELS, step=1)
    assert rewards.tolist() == pytest.approx([0.7, 0.7]) and scores.tolist() == rewards.tolist()
    judge.answer = "The answer 042 is correct"
    with pytest.raises(ValueError, match=r"the answer for query 0 of the batch is refused: its last line 'The answer "
                                         r"042 is correct' is not `Score: x` \(x from 0 to 1\) or `Verdict: yes`"):  # fmt: skip
        score(fn, name, QUERIES, PROMPTS, LABELS, step=1)
    judge.answer = "Score: 7"
    with pytest.raises(ValueError, match=r"refused: its score '7' is not from 0 to 1"):
        score(fn, name, QUERIES, PROMPTS, LABELS, step=1)


def test_an_answer_cut_at_max_tokens_says_so(stub, prompt_file):
    judge = stub(answer="Let me think step by step. First, 2+2")
    judge.finish_reason = "length"
    fn = JudgeReward(judge.url + "/v1", prompt_file, retries=0, max_tokens=16)
    with pytest.raises(ValueError, match=r"it was cut at --reward.judge-max-tokens 16"):
        fn(QUERIES, PROMPTS, LABELS)


# ------------------------------------------------------------------------------------- the whole call is timed
def test_a_judge_that_trickles_its_answer_times_out_as_a_whole(stub, prompt_file):
    """200 at once, then a byte every 0.25 s (a ~140-byte completion: ~35 s): `requests`' timeout bounds each read,
    so this ran to the end; `--reward.timeout-s` 1 must end each attempt after 1 s."""
    judge = stub(trickle_s=0.25)
    fn = JudgeReward(judge.url + "/v1", prompt_file, model="m", timeout_s=1.0, retries=1, concurrency=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"judge .* failed after 2 attempt\(s\): Timeout: no whole answer within 1 s"):  # fmt: skip
        fn(QUERIES[:1], PROMPTS[:1], LABELS[:1])
    assert time.monotonic() - t0 < 5  # two attempts of 1 s and a 1 s pause


def test_a_reward_server_that_trickles_its_answer_times_out_as_a_whole(stub):
    server = stub(trickle_s=0.25)  # {"rewards": [1.0, 1.0]}: 21 bytes, ~5 s
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reward server .*/get_reward failed after 1 attempt\(s\): Timeout"):
        RemoteReward([server.url], timeout_s=1.0, retries=0)(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - t0 < 2.5
    server.trickle_s = 0.0
    assert RemoteReward([server.url], timeout_s=1.0, retries=0)(QUERIES, PROMPTS, LABELS)["rewards"].tolist() == [1, 1]


# ------------------------------------------------------------------------------------- the judge at start
def test_a_dead_judge_is_named_at_start(prompt_file):
    """Before: nothing was asked until the first batch (after the models loaded), and then the error said "give
    --reward.judge-model", or, with the model given, failed on the first batch."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    for model in (None, "m"):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=rf"--reward.judge-url {dead}: the judge at {dead} does not answer \(GET "
                                             rf"{dead}/models, 1 attempt\(s\): ConnectionError"):  # fmt: skip
            load_reward_func(RewardConfig(judge_url=dead, judge_prompt=prompt_file, judge_model=model, retries=0))
        assert time.monotonic() - t0 < 5


def test_the_judge_is_asked_at_start_without_waiting_for_a_batch(stub, prompt_file):
    judge = stub()
    fn, _ = load_reward_func(RewardConfig(judge_url=judge.url + "/v1", judge_prompt=prompt_file))
    assert fn.model == "judge-model" and len(judge.seen) == 1  # GET /models, at start


# ------------------------------------------------------------------------------------- keys
def test_the_key_in_the_environment_is_sent_as_a_bearer_token(stub, prompt_file, monkeypatch):
    judge = stub(key="s3cret")
    monkeypatch.delenv("CLEANRLHF_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"the judge refused the request \(GET .*/models: HTTP 401\) \(no key was "
                                         r"sent; the key is read from the environment variable named by "
                                         r"--reward.api-key-env, default CLEANRLHF_API_KEY\)"):  # fmt: skip
        load_reward_func(RewardConfig(judge_url=judge.url + "/v1", judge_prompt=prompt_file))
    with pytest.raises(RuntimeError, match=r"/get_reward failed after 1 attempt\(s\): HTTP 401: .*no key was sent"):
        RemoteReward([judge.url], retries=2)(QUERIES, PROMPTS, LABELS)  # a 401 is not retried
    monkeypatch.setenv("CLEANRLHF_API_KEY", "s3cret")
    fn, name = load_reward_func(RewardConfig(judge_url=judge.url + "/v1", judge_prompt=prompt_file))
    assert score(fn, name, QUERIES, PROMPTS, LABELS, step=0)[0].tolist() == [1.0, 1.0]
    fn, name = load_reward_func(RewardConfig(remote_url=[judge.url]))
    assert score(fn, name, QUERIES, PROMPTS, LABELS, step=0)[0].tolist() == [1.0, 1.0]
    assert set(judge.seen[-4:]) == {"Bearer s3cret"}
    monkeypatch.setenv("MY_JUDGE_KEY", "s3cret")  # another variable, e.g. OPENAI_API_KEY for a hosted judge
    monkeypatch.setenv("CLEANRLHF_API_KEY", "other")
    fn, _ = load_reward_func(RewardConfig(judge_url=judge.url + "/v1", judge_prompt=prompt_file,
                                          api_key_env="MY_JUDGE_KEY"))  # fmt: skip
    assert judge.seen[-1] == "Bearer s3cret"


def test_a_key_variable_named_on_purpose_must_be_set(prompt_file, monkeypatch):
    monkeypatch.delenv("MY_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"--reward.api-key-env MY_JUDGE_KEY: the environment variable MY_JUDGE_KEY "
                                         r"is not set"):  # fmt: skip
        load_reward_func(RewardConfig(remote_url=["http://127.0.0.1:1"], api_key_env="MY_JUDGE_KEY"))


def test_a_dead_judge_stops_a_ray_launch_before_ray_starts(prompt_file, monkeypatch):
    """`--train.ranks N` starts Ray and the engines in `core.launch.launch` before any rank loads the task: the script
    asks the judge before it launches."""
    from algos.grpo import Args, main
    from core import placement

    monkeypatch.setattr(placement, "init_ray", lambda *a, **k: pytest.fail("Ray was started"))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    args = Args()
    args.train.ranks, args.reward = 2, RewardConfig(judge_url=dead, judge_prompt=prompt_file, retries=0)
    with pytest.raises(ValueError, match=rf"the judge at {dead} does not answer"):
        main(args)
