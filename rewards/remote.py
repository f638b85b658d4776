"""Reward sources with the `reward_func(queries, prompts, labels)` contract, for the RL scripts' `--reward.*` flags:

- `RemoteReward(urls)`: HTTP reward servers (`rewards/server.py`, or any server speaking OpenRLHF's
  `POST {"query", "prompts", "labels"} -> {"rewards": [...]}`), batches split across the URLs, with a time limit and
  retries per request, then one clear error naming the URL.
- `ModelReward(path)`: a reward model (an `algos/rm.py` export) scored in-process, no server needed.
- `GroupReward(group)`: the same reward model in a Ray group of replicas (`--reward.ranks N`, a
  `core.placement.ModelGroup` whose ranks each hold a `ModelReward`, built by `build_group_reward`): every batch is
  split over the replicas. The replicas run no collective, so several trainer ranks may call the group at once.

All return `{"rewards": tensor, "scores": tensor}` so the scripts treat them exactly like a python reward file.

HTTP calls (`call_json`) are bounded as a whole: `requests`' own timeout bounds each socket read, so a server that
answers 200 and then sends a byte every 2 s would hold a call forever; here the call runs in a daemon thread and the
caller stops waiting at `--reward.timeout-s`. A key (`--reward.api-key-env`, the environment variable holding it) is
sent as `Authorization: Bearer KEY`, as `python -m rewards.server --api-key` and the agent server expect.
"""

from __future__ import annotations

import json
import os
import threading
import time

import requests
import torch

DEFAULT_KEY_ENV = "CLEANRLHF_API_KEY"
"""the environment variable the reward server, the agent server and the RL scripts' client read the key from."""


def key_session(key_env: str | None) -> requests.Session:
    """A session that sends the key held by the environment variable `key_env` as a Bearer token. The default
    variable (`CLEANRLHF_API_KEY`) may be unset (no key is sent); another one, named on purpose, must be set."""
    session = requests.Session()
    key = os.environ.get(key_env) if key_env else None
    if key_env and key_env != DEFAULT_KEY_ENV and not key:
        raise ValueError(f"--reward.api-key-env {key_env}: the environment variable {key_env} is not set (or empty)")
    if key:
        session.headers["Authorization"] = f"Bearer {key}"
    return session


def _auth_hint(status: int, session) -> str:
    if status not in (401, 403):
        return ""
    sent = "a key was sent" if "Authorization" in session.headers else "no key was sent"
    return (f" ({sent}; the key is read from the environment variable named by --reward.api-key-env, default "
            f"{DEFAULT_KEY_ENV})")  # fmt: skip


def call_json(session, method: str, url: str, body: dict | None, timeout_s: float | None) -> tuple[int, bytes]:
    """One HTTP request (`body` sent as JSON when given): (status, the answer's bytes). The whole call (connect,
    headers and body) ends within `timeout_s` seconds (None: no limit) with `requests.Timeout`: it runs in a daemon
    thread the caller stops waiting for at the deadline. That thread stops itself at the next byte past the deadline
    (or at `requests`' per-read timeout, the same `timeout_s`), so a server that trickles leaves no reader behind."""
    deadline = None if not timeout_s else time.monotonic() + timeout_s
    result: dict = {}
    done = threading.Event()

    def call() -> None:
        try:
            with session.request(method, url, json=body, timeout=timeout_s, stream=True) as resp:
                chunks = []
                while chunk := resp.raw.read1(65536, decode_content=True):  # one socket read at most
                    chunks.append(chunk)
                    if deadline is not None and time.monotonic() > deadline:
                        raise requests.Timeout("past the deadline")  # nobody waits for this call any more
                result["out"] = (resp.status_code, b"".join(chunks))
        except BaseException as e:  # handed to the caller below
            result["error"] = e
        finally:
            done.set()

    if deadline is None:
        call()
    else:
        threading.Thread(target=call, name="http-call", daemon=True).start()
        if not done.wait(timeout_s):
            raise requests.Timeout(f"no whole answer within {timeout_s:g} s (--reward.timeout-s bounds the call)")
    if "error" in result:
        raise result["error"]
    return result["out"]


def post_with_retries(session, url: str, body: dict, timeout_s: float | None, retries: int, name: str):
    """POST `body` as JSON and return the (< 400) answer parsed from JSON, retried `retries` times (1 s, 2 s, ...
    pauses) after a timeout, a connection error or a 5xx; a 4xx fails at once (a bad request will not get better).
    Each attempt ends within `timeout_s` (`call_json`). The error names `name` (e.g. "reward server URL") and the last
    failure; an answer that is not JSON is a RuntimeError naming `name` too."""
    error, attempts = "", 0
    for attempt in range(retries + 1):
        attempts += 1
        try:
            status, content = call_json(session, "POST", url, body, timeout_s)
        except requests.RequestException as e:  # timeout, refused connection, ...
            error = f"{type(e).__name__}: {e}"
        else:
            if status < 400:
                try:
                    return json.loads(content)
                except ValueError:  # also a UnicodeDecodeError
                    raise RuntimeError(f"{name} answered HTTP {status} with something that is not JSON: "
                                       f"{content[:300]!r}") from None  # fmt: skip
            error = f"HTTP {status}: {content[:500].decode('utf-8', 'replace')}{_auth_hint(status, session)}"
            if status < 500:
                break
        if attempt < retries:
            time.sleep(attempt + 1)
    raise RuntimeError(f"{name} failed after {attempts} attempt(s): {error}")


class RemoteReward:
    """Score queries with one or more reward servers: the batch is split into one contiguous chunk per URL, so
    several servers share the work; each request is retried `retries` times (with 1 s, 2 s, ... pauses) after a
    timeout, a connection error or a 5xx, and fails at once on a 4xx (a bad request will not get better). The key in
    the environment variable `key_env` (if set) is sent as a Bearer token."""

    def __init__(self, urls: list[str], timeout_s: float | None = 60.0, retries: int = 3,
                 key_env: str | None = DEFAULT_KEY_ENV):  # None timeout: no time limit  # fmt: skip
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        self.urls = [u if u.rstrip("/").endswith("/get_reward") else u.rstrip("/") + "/get_reward" for u in urls]
        self.timeout_s, self.retries = timeout_s, retries
        self.session = key_session(key_env)

    def _post(self, url: str, body: dict) -> tuple[list[float], dict | None]:
        answer = post_with_retries(self.session, url, body, self.timeout_s, self.retries, f"reward server {url}")
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(body["query"]):
            raise ValueError(f"reward server {url} answered {str(rewards)[:200]!r}: expected a list "
                             f"'rewards' of {len(body['query'])} numbers")  # fmt: skip
        parts = answer.get("components")
        if parts is not None and not (isinstance(parts, dict) and all(
                isinstance(v, list) and len(v) == len(rewards) for v in parts.values())):  # fmt: skip
            raise ValueError(f"reward server {url} answered 'components' {str(parts)[:200]!r}: expected a dict of "
                             f"named lists of {len(rewards)} numbers, one per query")  # fmt: skip
        return rewards, parts

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        n, k = len(queries), len(self.urls)
        bounds = [round(i * n / k) for i in range(k + 1)]
        rewards: list[float] = []
        parts: dict[str, list] | None = None  # a server's named reward components (GDPO), joined over the URLs
        for url, lo, hi in zip(self.urls, bounds, bounds[1:]):
            if hi > lo:
                body = {"query": list(queries[lo:hi]), "prompts": list(prompts[lo:hi]), "labels": list(labels[lo:hi])}
                chunk, chunk_parts = self._post(url, body)
                if rewards and sorted(parts or []) != sorted(chunk_parts or []):
                    raise ValueError(f"reward server {url} answered components {sorted(chunk_parts or [])}, the "
                                     f"servers before it {sorted(parts or [])}: every server must give the same")  # fmt: skip
                parts = {k: [*(parts or {}).get(k, []), *v] for k, v in chunk_parts.items()} if chunk_parts else None
                rewards += chunk
        out = torch.tensor(rewards, dtype=torch.float32)
        return {"rewards": out, "scores": out, **({"components": parts} if parts else {})}


class ModelReward:
    """Score queries in-process with a reward model (`algos/rm.py` export): the server's scorer without HTTP."""

    def __init__(self, path: str, normalize: bool = False, batch_size: int = 64, device: str | None = None,
                 load_in_4bit: bool = False):  # fmt: skip
        from rewards.server import RewardScorer

        self.scorer = RewardScorer(path, normalize=normalize, batch_size=batch_size, device=device,
                                   load_in_4bit=load_in_4bit)  # fmt: skip

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        out = torch.tensor(self.scorer(list(queries)), dtype=torch.float32)
        return {"rewards": out, "scores": out}


def build_group_reward(worker, path: str, normalize: bool, load_in_4bit: bool = False) -> None:
    """On each rank of a reward group: the whole reward model of this replica (`worker.engine`)."""
    worker.engine = ModelReward(path, normalize, load_in_4bit=load_in_4bit)


def _score(worker, queries: list[str]) -> list[float]:
    worker.calls = getattr(worker, "calls", 0) + 1
    return worker.engine(queries, [], [])["rewards"].tolist() if queries else []


class GroupReward:
    """Score queries with a Ray group of reward-model replicas (`build_group_reward` run on it): the batch is split
    contiguously over the ranks (`ModelGroup.run_split`), each scores its share, the scores come back in order. A
    replica that dies or stalls past the group's timeout is a `core.placement.GroupError` naming the group and rank."""

    def __init__(self, group):
        self.group = group

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        out = torch.tensor(self.group.run_split(_score, list(queries)), dtype=torch.float32)
        return {"rewards": out, "scores": out}
