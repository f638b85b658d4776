"""Reward sources with the `reward_func(queries, prompts, labels)` contract, for the RL scripts' `--reward.*` flags:

- `RemoteReward(urls)`: HTTP reward servers (`rewards/server.py`, or any server speaking OpenRLHF's
  `POST {"query", "prompts", "labels"} -> {"rewards": [...]}`), batches split across the URLs, with a timeout and
  retries per request, then one clear error naming the URL.
- `ModelReward(path)`: a reward model (an `algos/rm.py` export) scored in-process, no server needed.
- `GroupReward(group)`: the same reward model in a Ray group of replicas (`--reward.ranks N`, a
  `core.placement.ModelGroup` whose ranks each hold a `ModelReward`, built by `build_group_reward`): every batch is
  split over the replicas. The replicas run no collective, so several trainer ranks may call the group at once.

All return `{"rewards": tensor, "scores": tensor}` so the scripts treat them exactly like a python reward file.
"""

from __future__ import annotations

import time

import requests
import torch


def post_with_retries(session, url: str, body: dict, timeout_s: float | None, retries: int, name: str):
    """POST `body` as JSON and return the (< 400) response, retried `retries` times (1 s, 2 s, ... pauses) after a
    timeout, a connection error or a 5xx; a 4xx fails at once (a bad request will not get better). The error names
    `name` (e.g. "reward server URL") and the last failure."""
    error, attempts = "", 0
    for attempt in range(retries + 1):
        attempts += 1
        try:
            resp = session.post(url, json=body, timeout=timeout_s)
        except requests.RequestException as e:  # timeout, refused connection, ...
            error = f"{type(e).__name__}: {e}"
        else:
            if resp.status_code < 400:
                return resp
            error = f"HTTP {resp.status_code}: {resp.text[:500]}"
            if resp.status_code < 500:
                break
        if attempt < retries:
            time.sleep(attempt + 1)
    raise RuntimeError(f"{name} failed after {attempts} attempt(s): {error}")


class RemoteReward:
    """Score queries with one or more reward servers: the batch is split into one contiguous chunk per URL, so
    several servers share the work; each request is retried `retries` times (with 1 s, 2 s, ... pauses) after a
    timeout, a connection error or a 5xx, and fails at once on a 4xx (a bad request will not get better)."""

    def __init__(self, urls: list[str], timeout_s: float | None = 60.0, retries: int = 3):  # None: no time limit
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        self.urls = [u if u.rstrip("/").endswith("/get_reward") else u.rstrip("/") + "/get_reward" for u in urls]
        self.timeout_s, self.retries = timeout_s, retries
        self.session = requests.Session()

    def _post(self, url: str, body: dict) -> list[float]:
        resp = post_with_retries(self.session, url, body, self.timeout_s, self.retries, f"reward server {url}")
        rewards = resp.json().get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(body["query"]):
            raise ValueError(f"reward server {url} answered {str(rewards)[:200]!r}: expected a list "
                             f"'rewards' of {len(body['query'])} numbers")  # fmt: skip
        return rewards

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        n, k = len(queries), len(self.urls)
        bounds = [round(i * n / k) for i in range(k + 1)]
        rewards: list[float] = []
        for url, lo, hi in zip(self.urls, bounds, bounds[1:]):
            if hi > lo:
                body = {"query": list(queries[lo:hi]), "prompts": list(prompts[lo:hi]), "labels": list(labels[lo:hi])}
                rewards += self._post(url, body)
        out = torch.tensor(rewards, dtype=torch.float32)
        return {"rewards": out, "scores": out}


class ModelReward:
    """Score queries in-process with a reward model (`algos/rm.py` export): the server's scorer without HTTP."""

    def __init__(self, path: str, normalize: bool = False, batch_size: int = 64, device: str | None = None):
        from rewards.server import RewardScorer

        self.scorer = RewardScorer(path, normalize=normalize, batch_size=batch_size, device=device)

    def __call__(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        out = torch.tensor(self.scorer(list(queries)), dtype=torch.float32)
        return {"rewards": out, "scores": out}


def build_group_reward(worker, path: str, normalize: bool) -> None:
    """On each rank of a reward group: the whole reward model of this replica (`worker.engine`)."""
    worker.engine = ModelReward(path, normalize)


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
