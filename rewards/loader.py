"""The RL scripts' `--reward.*` section: where rewards come from and how they are checked.

- `RewardConfig`: the flags (a python reward file, a reward model, remote URLs; clipping and length penalties, which
  the scripts apply after scoring).
- `load_reward_func(cfg)`: the chosen source as one `reward_func(queries, prompts, labels)` (OpenRLHF's contract).
- `score(...)`: calls it on one batch and checks the result (one finite reward per query), so a bad reward file
  fails with a message naming the file and the batch instead of a shape error deep inside the update.

A python reward function (the user's file or the embedded rule) runs under `--reward.timeout-s`, so one that never
returns stops the run with an error naming the file and the batch instead of hanging it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from core.flags import ModelPath, NonNegFloat, NonNegInt, PosFloat, PosInt
from core.placement import Group, group
from rewards.judge import JudgeReward
from rewards.remote import GroupReward, ModelReward, RemoteReward, build_group_reward


@dataclass
class RewardConfig:
    func: str | None = None
    """python file defining `reward_func(queries, prompts, labels)` returning a 1-D tensor/list of rewards (one number
    per query; booleans count as 1.0 / 0.0) or a dict with `rewards`, optional `scores` (0-1) and `extra_logs`
    (OpenRLHF's contract), and optional named `components` (`{"correct": [...], "format": [...]}`, one number per
    query each: the parts a multi-reward algorithm normalises apart, algos/gdpo.py). Default: rewards/arithmetic.py,
    the embedded task's exact-match rule."""
    model: ModelPath | None = None
    """reward model (an `algos/rm.py` export or any one-label `AutoModelForSequenceClassification`) scored
    in-process on prompt + response; instead of `func`."""
    remote_url: list[str] = field(default_factory=list)
    """reward server URL(s) (`python -m rewards.server`, or OpenRLHF's remote RM contract); several URLs split each
    batch between them; instead of `func`."""
    judge_url: str | None = None
    """a judge as the reward: base URL of an OpenAI-compatible chat endpoint (e.g. `http://host:8000/v1`, a vLLM
    server or `python -m agents.openai_server --model <run>/hf`) that scores each response with `judge-prompt`
    (rewards/judge.py: only the answer's last line is read, `Score: x` with x from 0 to 1 or `Verdict: yes|no`, so
    every reward is in [0, 1]); checked at start (a judge that does not answer stops the run); instead of `func`."""
    judge_prompt: str | None = None
    """with `judge-url`: the judge's message, a text file with {prompt}, {response} and {label} placeholders that asks
    for a last line `Score: x` (x from 0 to 1) or `Verdict: yes|no` (rewards/judge_prompt.txt is an example)."""
    judge_model: str | None = None
    """with `judge-url`: the model name to ask for (default: the endpoint's first model)."""
    judge_concurrency: int = 8
    """with `judge-url`: requests in flight at once."""
    judge_max_tokens: int = 256
    """with `judge-url`: the most tokens the judge may answer with (its reasoning and the final line)."""
    api_key_env: str = "CLEANRLHF_API_KEY"
    """with `remote-url` or `judge-url`: the environment variable holding the key sent to the server as
    `Authorization: Bearer KEY` (what `python -m rewards.server --api-key` and `python -m agents.openai_server
    --api-key` check; e.g. OPENAI_API_KEY for a hosted judge). The default may be unset (no key is sent); another
    variable, named on purpose, must be set. A variable, not the key itself: a flag would show in `ps` and be saved
    in the run's config.json."""
    normalize: bool = False
    """with `model`: score (r − reward_mean) / reward_std using the statistics `algos/rm.py` saved."""
    load_in_4bit: bool = False
    """with `model`: load the reward model's body in 4-bit NF4 (bitsandbytes; its score head stays in full
    precision), about a quarter of its 16-bit memory, in this process or in each `ranks` replica. Its scores carry
    NF4's rounding."""
    ranks: PosInt | None = None
    """with `model`: None scores in the trainer ranks' processes. N: a Ray group of N replicas of the reward model
    (each holds the whole model and scores its share of every batch), OpenRLHF's reward group; RL scripts started
    with Ray only (a one-process run is launched through Ray for it)."""
    colocate: bool = True
    """with `ranks`: replica i shares trainer rank i's placement bundle (at most `--train.ranks` replicas); off:
    bundles of its own."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """with `ranks` and `no-colocate`: how its own bundles are placed over the nodes (see `--ray.strategy`, the
    default)."""
    timeout_s: PosFloat = 60.0
    """seconds a python reward function (`func`, or the default rule) may take on one batch before the run stops with
    an error naming the file and the batch (it runs in a daemon thread, which is left behind); with `remote-url` or
    `judge-url`, seconds one request may take in all (connecting, waiting and reading the answer) before it is
    retried. 0: no limit (a python function then runs in the calling thread, e.g.
    for reward code that sets signal handlers, which only the main thread may). `model` is not timed."""
    retries: NonNegInt = 3
    """with `remote-url` or `judge-url`: retries per request (after a timeout, connection error or 5xx) before a clear
    error."""
    clip: PosFloat = 10.0
    """rewards are clipped to [−clip, clip]."""
    stop_properly_penalty: float | None = None
    """reward given instead to responses truncated at max-new-tokens (None: keep their reward)."""
    overlong_buffer: NonNegInt = 0
    """DAPO soft overlong punishment: responses within this many tokens of max-new-tokens lose reward linearly, up to
    `overlong-penalty-factor` at the limit (`rl_math.overlong_penalty`); 0 disables."""
    overlong_penalty_factor: NonNegFloat = 1.0
    """the largest overlong penalty (at max-new-tokens)."""


def load_reward_func(cfg: RewardConfig, group=None):
    """(reward_func, its name for messages): a remote server, a reward model (in this process, or in `group`, the Ray
    group of replicas that `--reward.ranks` starts), the user's python file, or the embedded task's rule reward. All
    follow OpenRLHF's contract `reward_func(queries, prompts, labels)`."""
    chosen = [name for name, on in (("func", cfg.func), ("model", cfg.model), ("remote-url", cfg.remote_url),
                                    ("judge-url", cfg.judge_url)) if on]  # fmt: skip
    if len(chosen) > 1:
        raise ValueError(f"--reward.{chosen[0]} and --reward.{chosen[1]}: give one reward source")
    if cfg.ranks is not None and not cfg.model:
        raise ValueError(f"--reward.ranks {cfg.ranks}: only for a reward model (--reward.model PATH)")
    if cfg.timeout_s < 0:
        raise ValueError(f"--reward.timeout-s {cfg.timeout_s}: must be >= 0 (0: no limit)")
    if bool(cfg.judge_url) != bool(cfg.judge_prompt):
        raise ValueError("--reward.judge-url and --reward.judge-prompt go together: the endpoint and the prompt file")
    if cfg.judge_url:
        judge = JudgeReward(cfg.judge_url, cfg.judge_prompt, cfg.judge_model, cfg.timeout_s or None, cfg.retries,
                            cfg.judge_concurrency, cfg.judge_max_tokens, cfg.api_key_env)  # fmt: skip
        return judge, f"judge {cfg.judge_url}"
    if cfg.remote_url:
        remote = RemoteReward(cfg.remote_url, cfg.timeout_s or None, cfg.retries, cfg.api_key_env)
        return remote, ", ".join(cfg.remote_url)
    if cfg.model:
        if group is not None:
            return GroupReward(group), f"{cfg.model} ({len(group)} replicas)"
        return ModelReward(cfg.model, cfg.normalize, load_in_4bit=cfg.load_in_4bit), cfg.model
    if cfg.func is None:
        from rewards.arithmetic import reward_func

        return with_timeout(reward_func, cfg.timeout_s), "rewards/arithmetic.py"
    path, file = cfg.func, Path(cfg.func).resolve()
    if not file.is_file():
        raise ValueError(f"--reward.func {path}: no such file")
    spec = importlib.util.spec_from_file_location("user_reward", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # named like an agent file's (agents/openai_agent.py), not a bare SyntaxError
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        code = f": {e.text.strip()!r}" if e.text and e.text.strip() else ""
        raise ValueError(f"--reward.func {path}, {where}: {e.msg}{code}") from None
    except Exception as e:  # an import, a name or a call at the top of the file failed
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == file]
        where = f", line {lines[-1]}" if lines else ""
        raise ValueError(f"--reward.func {path}{where}: importing it raised {type(e).__name__}: {e}") from e
    if not hasattr(module, "reward_func"):
        raise ValueError(f"--reward.func {path}: defines no `reward_func(queries, prompts, labels)`")
    return with_timeout(module.reward_func, cfg.timeout_s), path


def reward_group(cfg: RewardConfig) -> Group:
    """The reward model's Ray group as a script declares it (`core.placement.Group`): `--reward.ranks N` replicas of
    `--reward.model`, each built when the group starts (`build_group_reward`); no group without `--reward.ranks`."""
    if cfg.ranks is not None and not cfg.model:
        raise ValueError(f"--reward.ranks {cfg.ranks}: only for a reward model (--reward.model PATH)")
    return group(cfg, setup=functools.partial(build_group_reward, path=cfg.model, normalize=cfg.normalize,
                                              load_in_4bit=cfg.load_in_4bit))  # fmt: skip


def check_reward_source(cfg: RewardConfig) -> None:
    """What can be checked of the reward source before anything loads, for a driver that starts the models elsewhere
    (`core.launch.launch`, before Ray and the engines): a judge's prompt file and whether the judge answers."""
    if cfg.judge_url and cfg.judge_prompt:
        load_reward_func(cfg)  # a JudgeReward asks its endpoint when it is built; nothing else is built for a judge


class RewardTimeout(Exception):
    """A python reward function did not return within `--reward.timeout-s`."""


def with_timeout(reward_func, timeout_s: float):
    """`reward_func` called in a daemon thread and waited for at most `timeout_s` seconds (`RewardTimeout` after
    that); its exceptions reach the caller unchanged, and the caller's grad mode carries over. A thread that never
    returns cannot be stopped: it is left behind as a daemon, which does not keep the interpreter from exiting (a
    ThreadPoolExecutor's workers would). 0: `reward_func` itself, no thread and no limit."""
    if not timeout_s:
        return reward_func

    @functools.wraps(reward_func)
    def timed(queries, prompts, labels):
        result, grad = {}, torch.is_grad_enabled()

        def call():
            try:
                with torch.set_grad_enabled(grad):
                    result["out"] = reward_func(queries=queries, prompts=prompts, labels=labels)
            except BaseException as e:  # handed to the caller below
                result["error"] = e

        thread = threading.Thread(target=call, name="reward_func", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise RewardTimeout(f"did not return within {timeout_s:g} s (--reward.timeout-s)")
        if "error" in result:
            raise result["error"]
        return result["out"]

    return timed


def _is_number(v) -> bool:
    """A real number: int, float, bool, or a 0-d numpy / torch value of a real or bool dtype."""
    if isinstance(v, numbers.Real):
        return True
    if getattr(v, "ndim", None) != 0 or not hasattr(v, "dtype"):
        return False
    try:
        return not torch.as_tensor(v).is_complex()
    except (TypeError, ValueError, RuntimeError):  # e.g. a numpy object or string scalar
        return False


def _batch(step: int) -> str:
    """Where a reward call happened, for its errors: the training batch of step `step`, or an eval (step < 0, the
    executor's eval calls: the one before the first step and every later one)."""
    return "an eval (its greedy pass@1 or sampled pass@k prompts)" if step < 0 else f"batch {step}"


_NAN_LOGGED: set[tuple[str, str]] = set()  # (source, key) of extra_logs entries already warned about


def _not_one_per_query(source: str, what: str, step: int, n: int) -> ValueError:
    return ValueError(f"reward function {source} returned {what} on {_batch(step)}: expected one number per query "
                      f"({n} queries) as a list or a 1-D tensor, or a dict with them as 'rewards'")  # fmt: skip


def _one_per_query(values, name: str, source: str, step: int, n: int) -> torch.Tensor:
    """`values` (the function's `rewards` or `scores`) as a float32 tensor of shape (n,), or a ValueError naming the
    file and the batch. Accepted: a list / tuple of numbers, or a 1-D tensor / numpy array of a real dtype. Booleans
    count as numbers (True = 1.0), so an exact-match rule may return its comparisons as they are. Rejected: strings,
    None, dicts, nested lists and 2-D results, even (n, 1): flattening would hide a function that scores something
    else than one number per query."""

    def bad(what: str) -> ValueError:
        return _not_one_per_query(source, what, step, n)

    if isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            if not _is_number(v):
                raise bad(f"{name}[{i}] = {str(v)[:40]!r} of type {type(v).__name__}, not a number")
        values = torch.tensor([float(v) for v in values], dtype=torch.float32)
    elif torch.is_tensor(values) or hasattr(values, "__array__"):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise bad(f"{name} of type {type(values).__name__} holding {getattr(values, 'dtype', '?')}") from None
        if values.is_complex():
            raise bad(f"{name} of dtype {values.dtype}")
        if values.ndim != 1:
            raise bad(f"{name} of shape {tuple(values.shape)}")
        values = values.to(torch.float32)
    else:
        raise bad(f"{name} of type {type(values).__name__}")
    if values.numel() != n:
        raise ValueError(f"reward function {source} returned {values.numel()} {name} for {n} queries on {_batch(step)}")
    if not torch.isfinite(values).all():
        bad_idx = (~torch.isfinite(values)).nonzero().flatten().tolist()[:5]
        raise ValueError(f"reward function {source} returned NaN/inf on {_batch(step)} ({name} of queries {bad_idx})")
    return values


def score(reward_func, source: str, queries, prompts, labels,
          step: int) -> tuple[torch.Tensor, dict, torch.Tensor, list[dict]]:  # fmt: skip
    """Call the reward function and check what it returned: one finite reward per query (see `_one_per_query` for
    what counts), and likewise the optional `scores`. Returns (rewards, logs, scores, extras): `scores` are the
    function's optional 0-1 scores (for dynamic filtering), else the rewards; `logs` the batch means of its
    `extra_logs`; `extras` one dict per query of the `extra_logs` entries that hold one number per query (kept with
    the samples, core/samples.py)."""
    try:
        out = reward_func(queries=queries, prompts=prompts, labels=labels)
    except RewardTimeout as e:
        raise ValueError(f"reward function {source} {e} on {_batch(step)}") from None
    except Exception as e:
        raise ValueError(f"reward function {source} raised on {_batch(step)}: {type(e).__name__}: {e}") from e
    if isinstance(out, dict) and "rewards" not in out:
        raise _not_one_per_query(source, f"a dict without 'rewards' (keys {sorted(map(str, out))})", step, len(queries))
    rewards = _one_per_query(out["rewards"] if isinstance(out, dict) else out, "rewards", source, step, len(queries))
    logs, extras = {}, [{} for _ in queries]
    for k, v in (out.get("extra_logs") or {} if isinstance(out, dict) else {}).items():
        try:
            values = torch.as_tensor(v, dtype=torch.float32)
            logs[f"rollout/{k}"] = values.mean().item()
            if values.ndim == 1 and len(values) == len(queries):
                for extra, x in zip(extras, values.tolist()):
                    extra[k] = x
            if math.isnan(logs[f"rollout/{k}"]) and (source, k) not in _NAN_LOGGED:
                _NAN_LOGGED.add((source, k))
                warnings.warn(f"reward function {source}: extra_logs[{k!r}] holds NaN on {_batch(step)}; it is logged "
                              f"as rollout/{k} = nan (warned once)", stacklevel=2)  # fmt: skip
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"reward function {source} returned extra_logs[{k!r}] that is not numbers on "
                             f"{_batch(step)}: {type(e).__name__}: {e}") from None  # fmt: skip
    for name, values in components(out, source, step, len(queries)).items():  # kept per query, as `component/<name>`
        logs[f"reward/{name}"] = values.mean().item()
        for extra, x in zip(extras, values.tolist()):
            extra[f"component/{name}"] = x
    scores = out.get("scores") if isinstance(out, dict) else None
    scores = rewards if scores is None else _one_per_query(scores, "scores", source, step, len(queries))
    return rewards, logs, scores, extras


def components(out, source: str, step: int, n: int) -> dict[str, torch.Tensor]:
    """The reward function's named reward components, `out["components"]`: a dict of names to one finite number per
    query each (checked as the rewards are, the error naming the file, the batch and the component), {} when it
    gives none. A step's rollout keeps them per episode (`Episode.extra["component/<name>"]`) and logs their batch
    means as `reward/<name>`."""
    parts = out.get("components") if isinstance(out, dict) else None
    if parts is None:
        return {}
    if not isinstance(parts, dict) or not parts:
        raise ValueError(f"reward function {source} returned 'components' of type {type(parts).__name__} on "
                         f"{_batch(step)}: expected a dict of named components, each one number per query")  # fmt: skip
    checked = {}
    for name, values in parts.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"reward function {source} returned a component named {name!r} on {_batch(step)}: "
                             "names are non-empty text without '/'")  # fmt: skip
        checked[name] = _one_per_query(values, f"components[{name!r}]", source, step, n)
    return checked
