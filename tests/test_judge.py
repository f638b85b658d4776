"""`--reward.judge-url URL --reward.judge-prompt FILE` (rewards/judge.py): what is read from a judge's answer (its last
line, `Score: x` or `Verdict: yes|no`), the prompt file's checks, and the HTTP path against a stand-in OpenAI chat
endpoint that answers, fails, stalls and rambles on cue. The judge's misreadings, trickling answers, dead judges and
keys: tests/test_judge_faults.py."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rewards.judge import JudgeReward, load_prompt, parse_verdict
from rewards.loader import RewardConfig, load_reward_func, score


@pytest.mark.parametrize(("answer", "reward"), [
    ("Score: 7/10", 0.7), ("Score: 0.25", 0.25), ("The sum is right.\n\nScore: 1", 1.0), ("score:0", 0.0),
    ("**Score:** 0.8", 0.8), ("Score: 2.5e-1.", 0.25), ("Verdict: yes", 1.0), ("VERDICT: No.", 0.0),
    ("Step 1 ... Verdict: no\nVerdict: yes\n\n", 1.0), ("`Verdict: yes`", 1.0),
])  # fmt: skip
def test_the_last_line_is_read(answer, reward):
    assert parse_verdict(answer) == pytest.approx(reward)


def test_the_prompt_file_is_checked_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"--reward.judge-prompt .*nope.txt: no such file"):
        load_prompt(str(tmp_path / "nope.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("Is {answer} right for {prompt}? {response}")
    with pytest.raises(ValueError, match=r"bad.txt: unknown placeholder\(s\) \['answer'\]"):
        load_prompt(str(bad))
    blind = tmp_path / "blind.txt"
    blind.write_text("Is this right: {prompt}?")
    with pytest.raises(ValueError, match=r"blind.txt: no \{response\} placeholder"):
        load_prompt(str(blind))
    braces = tmp_path / "braces.txt"
    braces.write_text('Answer in JSON {{"ok": true}}: {response}\nVerdict: yes|no')
    assert load_prompt(str(braces)).format(prompt="", response="x", label="") == (
        'Answer in JSON {"ok": true}: x\nVerdict: yes|no'
    )
    with pytest.raises(ValueError, match="go together"):
        load_reward_func(RewardConfig(judge_url="http://127.0.0.1:1/v1"))


class Judge:
    """A stand-in chat endpoint on a free local port: answers "Verdict: yes" when the message holds the label's text
    after "Answer:", else "Verdict: no"; `fail_first` requests get a 503, `status` forces a status, `delay_s` stalls each answer,
    `answer` forces the text."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_first, self.status, self.delay_s, self.answer = 0, None, 0.0, None
        judge = self

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
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (the timeout test)
                    pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "judge-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append(body)
                time.sleep(judge.delay_s)
                if len(judge.requests) <= judge.fail_first:
                    return self._send(503, {"error": "busy"})
                if judge.status:
                    return self._send(judge.status, {"error": {"message": "bad request"}})
                text = body["messages"][0]["content"]
                label, answer = text.split("Label: ")[1].split("\n")[0], text.split("Answer: ")[1].split("\n")[0]
                verdict = judge.answer if judge.answer is not None else f"Verdict: {'yes' if answer == label else 'no'}"
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict},
                                              "finish_reason": "stop"}]})  # fmt: skip

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def judge():
    j = Judge()
    yield j
    j.close()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Question: {prompt}\nLabel: {label}\nAnswer: {response}\nIs the answer right? End with the line "
                    "`Verdict: yes` or `Verdict: no`.")  # fmt: skip
    return str(path)


QUERIES, PROMPTS, LABELS = ["12+30=042", "12+30=043", "99+01=100"], ["12+30=", "12+30=", "99+01="], ["042", "042", "100"]


def test_the_judge_scores_each_response_through_the_flags(judge, prompt_file):
    fn, name = load_reward_func(RewardConfig(judge_url=judge.url, judge_prompt=prompt_file, judge_concurrency=2))
    rewards, logs, scores, _ = score(fn, name, QUERIES, PROMPTS, LABELS, step=3)
    assert rewards.tolist() == [1.0, 0.0, 1.0] and scores.tolist() == [1.0, 0.0, 1.0]
    assert name == f"judge {judge.url}" and len(judge.requests) == 3
    first = judge.requests[0]
    assert first["model"] == "judge-model" and first["temperature"] == 0.0  # the endpoint's first model, greedy
    assert any("Answer: 042\n" in r["messages"][0]["content"] for r in judge.requests)  # the response, not the query


def test_a_busy_judge_is_retried_and_a_refusal_is_not(judge, prompt_file):
    judge.fail_first = 2
    fn = JudgeReward(judge.url, prompt_file, model="m", retries=2, concurrency=1)
    assert fn(QUERIES[:1], PROMPTS[:1], LABELS[:1])["rewards"].tolist() == [1.0]
    assert len(judge.requests) == 3  # two 503s, then the answer
    judge.requests.clear()
    judge.fail_first, judge.status = 0, 400
    with pytest.raises(RuntimeError, match=r"judge http://127.0.0.1:\d+/v1 failed after 1 attempt\(s\): HTTP 400"):
        fn(QUERIES[:1], PROMPTS[:1], LABELS[:1])


def test_a_stalled_judge_times_out_with_its_url(judge, prompt_file):
    judge.delay_s = 2.0
    fn = JudgeReward(judge.url, prompt_file, model="m", timeout_s=0.3, retries=1, concurrency=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed after 2 attempt\(s\): (Read)?Timeout"):
        fn(QUERIES[:1], PROMPTS[:1], LABELS[:1])
    assert time.monotonic() - t0 < 5


def test_an_answer_without_a_verdict_stops_the_run_naming_the_query(judge, prompt_file):
    judge.answer = "Hard to say."
    fn, name = load_reward_func(RewardConfig(judge_url=judge.url, judge_prompt=prompt_file))
    with pytest.raises(ValueError, match=r"judge .* raised on batch 5: ValueError: judge .*: the answer for query 0 of "
                                         r"the batch is refused: its last line 'Hard to say.' is not `Verdict: yes` or "
                                         r"`Verdict: no`: 'Hard to say.' \(--reward.judge-prompt .*judge.txt asks"):  # fmt: skip
        score(fn, name, QUERIES, PROMPTS, LABELS, step=5)


@pytest.mark.slow
def test_our_own_server_hosting_a_model_is_a_judge(tmp_path):
    """The judge path end to end against this project's server (`python -m agents.openai_server --model
    cleanrlhf/tiny-chat`, a real process), with a realistic prompt file: the model name comes from the server's
    `/v1/models`, every query is asked at temperature 0, and what the judge reads is exactly the server's greedy
    answer (the same request through the `openai` client gives the same text). What it does not show: a verdict that
    parses. The embedded tiny-chat model is untrained on judging and answers this prompt with blank lines (measured,
    greedy, so deterministic), which must stop the run with the documented error naming the query and the answer.
    The prompt is the shipped example, rewards/judge_prompt.txt."""
    import openai
    from test_serve import MODEL, served

    path = Path(__file__).resolve().parents[1] / "rewards" / "judge_prompt.txt"
    with served(MODEL, tmp_path / "serve.log") as (_, url):
        fn, name = load_reward_func(RewardConfig(judge_url=url, judge_prompt=str(path), judge_concurrency=2))
        assert name == f"judge {url}" and fn.model == MODEL
        client = openai.OpenAI(base_url=url, api_key="none")
        answers = []
        for q, p, lab in zip(QUERIES, PROMPTS, LABELS):
            text = path.read_text().format(prompt=p, response=q[len(p):], label=lab)
            answers.append(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                          temperature=0, max_tokens=fn.max_tokens)
                           .choices[0].message.content)  # fmt: skip
            assert fn.ask(text)[0] == answers[-1]  # the judge reads the server's greedy answer, unchanged
        for a in answers:
            with pytest.raises(ValueError):
                parse_verdict(a)  # tiny-chat does not answer with a verdict line
        with pytest.raises(ValueError, match=rf"judge .* raised on batch 2: ValueError: judge {re.escape(url)}: the "
                                             r"answer for query 0 of the batch is refused: .*"
                                             + re.escape(repr(answers[0][-200:]))):  # fmt: skip
            score(fn, name, QUERIES, PROMPTS, LABELS, step=2)
