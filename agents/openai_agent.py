"""`OpenAIAgentExecutor`: episodes written as ordinary async Python against the OpenAI API (`--rollout.agent-file`).

The agent file defines

    async def agent(client: openai.AsyncOpenAI, example: dict) -> float:
        out = await client.completions.create(model="policy", prompt=example["prompt"])
        ...more calls, tools, environments...
        return reward

`client` is the official `openai.AsyncOpenAI`, its base URL pointing at this process's `agents.openai_server`
(which generates with the run's vLLM engines and records every call as token ids); `example` is a copy of the dataset
row (prompt, prompt_ids, label, datasource, ...). The returned number is the episode's reward (its 0-1 score for the
DAPO filter: the reward clipped to [0, 1]). The trained trajectory is rebuilt from the recorded calls
(`openai_server.build_trajectory`): the model's tokens exactly as sampled, with action mask 1 and the engine's
log-probs, everything else in between with mask 0. Up to `--rollout.agent-concurrency` episodes run at once on one
asyncio loop, and their concurrent requests are batched into the engines.

A failed episode ends without stopping the run: the agent raised (`raised`; an HTTP 4xx it did not catch:
`bad_request`), did not return within `--rollout.agent-timeout-s` (`timeout`; it is cancelled), returned something
that is not a finite number (`bad_reward`), or made no model call (`no_calls`: nothing to train on). Such an episode
gets reward 0 (it counts as a failure in its group's baseline and in rollout/reward_mean), a single masked token
(action mask 0: nothing of it is trained on) and `finish_reason` `agent_<kind>`; the step logs one warning line with
the counts and the first error, and the metrics `rollout/agent_errors` (failed episodes), `rollout/agent_timeouts`,
`rollout/agent_bad_requests` (requests answered 4xx, caught or not), `rollout/agent_calls_mean` and
`rollout/agent_dropped_calls` (calls outside the trained chain). A batch where every episode fails raises
`AgentError` naming the agent file and the first error. An engine failure is not the agent's: it is raised as is.

Every trainer process that rolls out runs its own server (with `--train.ranks N`, each rank for its share).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import math
import ssl
from collections import Counter
from pathlib import Path

import torch

from agents.executor import Episode, Rollout
from agents.openai_server import OpenAIServer, build_trajectory

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """Every episode of a batch failed: the agent file is broken, not one episode unlucky."""


def load_agent(path: str):
    """`agent` from a Python file (`--rollout.agent-file`): `async def agent(client, example) -> float`. Errors name
    the file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--rollout.agent-file {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"cleanrlhf_agent_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    fn = getattr(module, "agent", None)
    if not inspect.iscoroutinefunction(fn):
        raise AttributeError(f"--rollout.agent-file {path}: defines no `async def agent(client, example) -> float`")
    return fn


class OpenAIAgentExecutor:
    """`run(batch, n, seed, step)` -> `Rollout`, as the other executors, with each episode an `agent(client, example)`
    coroutine talking to an OpenAI-compatible server over the engines (see the module docstring)."""

    def __init__(self, engines, tokenizer, agent_file: str, model_name: str, max_new_tokens: int, max_context: int,
                 temperature: float = 1.0, top_p: float = 1.0, concurrency: int = 128,
                 timeout_s: float = 300.0):  # fmt: skip
        self.agent_file, self.agent = agent_file, load_agent(agent_file)
        self.tokenizer, self.temperature = tokenizer, temperature
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.server = OpenAIServer(engines, tokenizer, model_name, max_new_tokens, max_context, top_p)
        self.server.start()
        self._ssl = ssl.create_default_context()  # made once: httpx builds one per client otherwise (~17 ms each here)

    def close(self) -> None:
        self.server.close()

    def run(self, batch: list[dict], n: int, seed: int | list[int] | None, step: int,
            temperature: float | None = None) -> Rollout:  # fmt: skip
        """n episodes per row of `batch` (prompt-major); episode j of row i samples with seed `seed + i·n + j` (int
        `seed`) or `seed[i] + j` (one per row), its k-th call with that + 7919·k; `temperature` overrides the
        rollout's (0: greedy, for evaluation)."""
        temperature = self.temperature if temperature is None else temperature
        rows = [e for e in batch for _ in range(n)]
        seeds = [None if seed is None else (seed[i // n] + i % n if isinstance(seed, list) else seed + i)
                 for i in range(len(rows))]  # fmt: skip
        results = asyncio.run(self._run_all(rows, seeds, temperature))
        if self.server.engine_error is not None:
            raise self.server.engine_error
        episodes, rewards, errors = [], [], []
        calls = dropped = bad = 0
        for i, (example, (reward, error, record)) in enumerate(zip(rows, results)):
            bad += record.bad_requests
            calls += len(record.calls)
            if error is None and not record.calls:
                error = ("no_calls", "the agent made no model call: there is nothing to train on")
            if error is None:
                prompt_ids, token_ids, logprobs, mask, n_dropped = build_trajectory(record.calls)
                last = record.calls[-1]
                episodes.append(Episode(example, prompt_ids, token_ids, logprobs, mask, last.finish_reason == "length",
                                        last.finish_reason))  # fmt: skip
                rewards.append(reward)
                dropped += n_dropped
                continue
            errors.append((i, *error))
            # DECISION: reward 0, one masked token: counted in the group baseline, never trained on
            episodes.append(Episode(example, list(example["prompt_ids"]), [self.tokenizer.eos_token_id], [0.0], [0],
                                    False, f"agent_{error[0]}"))  # fmt: skip
            rewards.append(0.0)
        if errors:
            self._report(errors, rows, step)
        kinds = Counter(kind for _, kind, _ in errors)
        r = torch.tensor(rewards, dtype=torch.float32)
        logs = {"rollout/agent_errors": float(len(errors)), "rollout/agent_timeouts": float(kinds["timeout"]),
                "rollout/agent_bad_requests": float(bad), "rollout/agent_calls_mean": calls / max(len(rows), 1),
                "rollout/agent_dropped_calls": float(dropped)}  # fmt: skip
        return Rollout(episodes, r, r.clamp(0, 1), logs)

    def _report(self, errors: list[tuple[int, str, str]], rows: list[dict], step: int) -> None:
        i, kind, message = errors[0]
        where = "the eval" if step < 0 else f"step {step}"
        first = f"episode {i} (prompt {rows[i].get('prompt', '')[:80]!r}): {kind}: {message}"
        if len(errors) == len(rows):
            raise AgentError(f"--rollout.agent-file {self.agent_file}: all {len(rows)} episodes of {where} failed; "
                             f"the first: {first}")  # fmt: skip
        counts = ", ".join(f"{k} {c}" for k, c in sorted(Counter(k for _, k, _ in errors).items()))
        log.warning(f"[agents] {self.agent_file}: {len(errors)} of {len(rows)} episodes of {where} failed ({counts}; "
                    f"reward 0, not trained on); the first: {first}")  # fmt: skip

    async def _run_all(self, rows: list[dict], seeds: list[int | None], temperature: float) -> list:
        gate = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*[self._episode(gate, e, s, temperature) for e, s in zip(rows, seeds)])

    async def _episode(self, gate: asyncio.Semaphore, example: dict, seed: int | None, temperature: float):
        """(reward, error (kind, message) or None, the server's record) of one episode."""
        import httpx
        import openai

        async with gate:
            eid = self.server.open_episode(temperature, seed)
            # One HTTP connection pool per episode: httpcore's pool checks every connection on each request, which
            # cost ~20 ms a request with one pool shared by 64 episodes here. trust_env=False: no proxy for 127.0.0.1.
            # max_retries=0: a retried request would be a second generation.
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, verify=self._ssl) as http:
                    client = openai.AsyncOpenAI(base_url=self.server.episode_url(eid), api_key="cleanrlhf",
                                                http_client=http, max_retries=0)  # fmt: skip
                    reward, error = await self._play(client, example)
            finally:
                record = self.server.close_episode(eid)
            return reward, error, record

    async def _play(self, client, example: dict) -> tuple[float, tuple[str, str] | None]:
        """Run the agent on one example: (reward, None), or (0.0, (kind, message)) when it failed."""
        import openai

        try:
            value = await asyncio.wait_for(self.agent(client, dict(example)), self.timeout_s)
        except TimeoutError:
            return 0.0, ("timeout", f"did not return within {self.timeout_s:g} s (--rollout.agent-timeout-s)")
        except openai.APIStatusError as e:
            return 0.0, ("bad_request" if 400 <= e.status_code < 500 else "raised", f"{type(e).__name__}: {e}")
        except Exception as e:  # the agent's own bug or an unreachable tool: this episode fails, the run goes on
            return 0.0, ("raised", f"{type(e).__name__}: {e}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return 0.0, ("bad_reward", f"returned {value!r}; the agent must return a finite number (the reward)")
        return float(value), None
