"""Generation running ahead of training (algos/grpo_async.py): rank 0's producer thread asks the vLLM engines (Ray
actors, their own processes) for step t+1's rollout while the training loop trains on step t's.

    pipeline = producer.start(run, args, train_set, refill, cleanup, max_lag=1, partial_rollout=None)
    for step in ...:
        ro = pipeline.take(step)                  # step t's rollout, sampled by the weights of update t − L
        ... update ...
        ahead = pipeline.engines_idle_for(step)   # the engines are idle: sync the weights, eval, checkpoint `ahead`
        pipeline.synced_update(step)              # the engines hold the new weights: the producer goes on

Which weights sample which step is fixed by `--train.max-lag` L, not by the threads' timing (see `Pipeline`), so a
run is reproducible, and a checkpoint that carries the rollouts generated ahead resumes exactly.

Partial rollout (`--train.partial-rollout N`; OpenRLHF's --partial_rollout, AReaL's interruptible generation): the
sync of update t − L + 1 no longer waits for step t's rollout to finish. The producer generates the first N tokens of
every response of step t, pauses there (`Pipeline.pause`: the trainer syncs, evaluates and checkpoints meanwhile) and
continues the unfinished responses under the new weights (`interrupted_rollout`). Where the interruption falls is
fixed too (after N tokens of step t, for the sync of update t − L + 1), so a run stays reproducible; every token
carries the version of the weights that sampled it (`TaggedEpisode.versions`) next to its log-prob under them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import threading
import time
from functools import partial

import numpy as np
import torch

from core import placement, rl, rollout
from core.episode import Episode, Rollout
from core.placement import all_ranks


@dataclasses.dataclass
class TaggedEpisode(Episode):
    """An episode of a partial rollout: `versions[k]` is the version of the weights (the number of updates behind
    them) that sampled `token_ids[k]`, whose log-prob under those weights is `logprobs[k]`."""

    versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class InFlight:
    """A step's rollout interrupted by a weight sync (partial rollout): its first segment, n samples per prompt. A
    checkpoint taken during the sync keeps it, and the resumed run continues it under the checkpoint's weights."""

    groups: list[list[rollout.Sample]]


class _Stopped(Exception):
    """The pipeline stopped while the producer waited inside a step."""


class Pipeline:
    """The hand-off between the producer thread (rank 0), which generates rollouts, and the training loop.

    `synced` counts the updates whose weights are in the engines; `ready[t]` holds step t's rollout once generated.
    The producer starts step t when synced >= t − lag; the trainer syncs update u + 1 only after every step up to
    u + lag is generated. Together: step t is sampled by exactly the weights of update max(t − lag, first step), and
    the engines never generate during a sync or an eval. Errors of the producer are raised in the trainer.

    Partial rollout: `produce` may stop inside step t at `pause(t, in_flight)` (for step t ≥ first + lag, lag ≥ 1),
    which waits for the weights of update t − lag + 1, the next ones; the trainer then syncs them once step t is paused
    there instead of once it is generated. Each step is still sampled by fixed weights: its first segment by those of
    update t − lag, the rest by those of update t − lag + 1.

    `produce(step, version) -> rollout` runs in the thread (`thread.start()` starts it); `carried` holds rollouts
    generated before (a checkpoint's), trained first, and at most one `InFlight` step, continued first. With `world`
    > 1 the ranks > 0 pass `produce` None (no thread) and `take` gives them rank 0's rollouts (a broadcast: every rank
    calls it)."""

    def __init__(self, produce, first: int, last: int, lag: int, carried: dict, world: int = 1):
        self.produce, self.last, self.lag, self.world = produce, last, lag, world
        self.synced, self.error, self.stopped = first, None, False
        self.ready = {t: r for t, r in carried.items() if not isinstance(r, InFlight)}
        self.in_flight = {t: r for t, r in carried.items() if isinstance(r, InFlight)}  # paused inside their step
        self.generated = first + len(self.ready)  # steps < generated are in `ready` or already trained on
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def _run(self) -> None:
        try:
            for t in range(self.generated, self.last):
                with self.cond:
                    self.cond.wait_for(lambda t=t: self.synced >= t - self.lag or self.stopped)
                    if self.stopped:
                        return
                    version = self.synced
                item = self.produce(t, version)
                with self.cond:
                    self.ready[t], self.generated = item, t + 1
                    self.cond.notify_all()
        except _Stopped:
            return
        except BaseException as e:  # handed to the trainer, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait(self, done) -> None:
        with self.cond:
            self.cond.wait_for(lambda: done() or self.error is not None)
            if self.error is not None:
                raise self.error

    def take(self, t: int):
        """Step t's rollout (waits for it)."""
        item = None
        if self.produce is not None:
            self._wait(lambda: t in self.ready)
            with self.cond:
                item = self.ready.pop(t)
        return all_ranks(item, self.world)

    def engines_idle_for(self, t: int) -> dict:
        """Wait until every rollout that the weights before update t + 1 must sample is generated (partial rollout:
        step t + lag's first segment); the engines are then idle until `synced_update(t)`. Returns those rollouts
        (steps t + 1 .. t + lag, the last maybe `InFlight`), which a checkpoint keeps ({} on the ranks > 0)."""
        if self.produce is None:
            return {}
        self._wait(lambda: self.generated >= min(t + self.lag + 1, self.last) or t + self.lag in self.in_flight)
        with self.cond:
            return {**self.ready, **self.in_flight}

    def resumed(self, t: int) -> InFlight | None:
        """Step t's first segment if a checkpoint carried it `InFlight` (then `produce` continues it), else None."""
        with self.cond:
            return self.in_flight.pop(t, None)

    def pause(self, t: int, in_flight: InFlight) -> int:
        """Partial rollout, in the producer thread: step t's first segment is generated (by the weights of update
        t − lag); wait while the trainer syncs the next weights (and checkpoints `in_flight`), then return their
        version, t − lag + 1, to generate the rest of the step with."""
        with self.cond:
            self.in_flight[t] = in_flight
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.synced > t - self.lag or self.stopped)
            del self.in_flight[t]
            if self.stopped:
                raise _Stopped
            return self.synced

    def synced_update(self, t: int) -> None:
        """The engines hold the weights after step t's update: the producer may go on."""
        with self.cond:
            self.synced = t + 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=60)


def start_engines(args, device: torch.device, cleanup: contextlib.ExitStack) -> rollout.RolloutEngines:
    """`--train.ranks 1`: the vLLM engines as Ray actors (their own processes, so that they generate while this one
    trains), on Ray started here unless it runs already; the engines, and Ray if started here, stop with `cleanup`.
    On CPU this process leaves the engines their cores (one per tensor-parallel worker): oversubscribed, a step took
    12 s instead of 0.5 s on 2 cores (OpenMP threads spinning)."""
    import ray

    if device.type == "cpu":
        free = len(os.sched_getaffinity(0)) - args.vllm.num_engines * args.vllm.tensor_parallel_size
        torch.set_num_threads(max(1, min(torch.get_num_threads(), free)))
    if not ray.is_initialized():
        placement.init_ray(args.ray)  # on this machine, or the cluster at --ray.address
        cleanup.callback(ray.shutdown)
    # the broadcast group (`--vllm.sync-backend broadcast`) is formed by rl.start, as for the launcher's engines
    engines = rollout.create_engines(args.actor.model.name_or_path, args.vllm, seed=args.train.seed,
                                     init_broadcast=False, tokenizer=args.actor.model.tokenizer)  # fmt: skip
    cleanup.callback(engines.shutdown)
    return engines


def tag(ro: Rollout, versions: list[list[int]] | int) -> Rollout:
    """The rollout with its episodes as `TaggedEpisode`s carrying `versions`: one list per episode, or one version
    for every token."""
    if isinstance(versions, int):
        versions = [[versions] * len(e.token_ids) for e in ro.episodes]
    ro.episodes = [TaggedEpisode(**vars(e), versions=v) for e, v in zip(ro.episodes, versions, strict=True)]
    return ro


def interrupted_rollout(run: rl.Run, ro_cfg, cut: int, train_set: list[dict], step: int, version: int,
                        pipeline: Pipeline, refill=None, in_flight: InFlight | None = None) -> Rollout:  # fmt: skip
    """Step `step`'s rollout with a weight sync inside it (partial rollout; `ro_cfg`: the `--rollout.*` section): the
    first `cut` (`--train.partial-rollout`) tokens of every response under the weights of `version` (update step −
    lag), then `pipeline.pause` (the trainer
    syncs the next weights), then the unfinished responses continued under those (`rollout.generate_segment`). A
    step a checkpoint carried (`in_flight`) starts at its second segment. The script's refill policy (`refill`, e.g. DAPO's
    `rl.refill`) comes after the sync: its further rounds are generated whole under the new weights. Scored by the run's executor, episodes tagged per token."""
    ex, G, max_new = run.executor, ro_cfg.n_samples, ro_cfg.max_new_tokens
    prompts, seeds = rl.step_prompts(run, ro_cfg, train_set, step)
    segment = partial(rollout.generate_segment, run.engines, [p["prompt_ids"] for p in prompts], G, max_new,
                      temperature=ex.temperature, top_p=ex.top_p, seed=seeds)  # fmt: skip
    pause_s = 0.0
    if in_flight is None:
        in_flight = InFlight(segment(until=cut, segment=0, version=version))
        t0 = time.perf_counter()
        version = pipeline.pause(step, in_flight)  # the engines idle: sync, eval, checkpoint
        pause_s = time.perf_counter() - t0
    groups = segment(until=max_new, segment=1, version=version, groups=in_flight.groups)
    samples = [s for g in groups for s in g]
    scorer = copy.copy(ex)  # the run's single-turn executor over engines that hand back these samples: it scores them
    scorer.engines = _Generated(groups)
    ro = scorer.run(prompts, G, seeds, step)
    assert [e.token_ids for e in ro.episodes] == [s.token_ids for s in samples], "episodes out of sample order"
    ro = tag(ro, [s.versions for s in samples])
    if refill is not None:

        def more(round_: int) -> Rollout:
            return tag(rl.generate(run, ro_cfg, train_set, step, round_), version)

        ro = refill(ro, more, G)
    ro.logs["perf/pause_s"] = pause_s
    return ro


class _Generated:
    """Stands in for the engines of a single-turn executor (agents/executor.py) that scores samples already
    generated: `generate` returns them."""

    def __init__(self, groups: list[list[rollout.Sample]]):
        self.groups = groups

    def generate(self, prompt_token_ids: list[list[int]], **_) -> list[list[rollout.Sample]]:
        assert len(prompt_token_ids) == len(self.groups), (len(prompt_token_ids), len(self.groups))
        return self.groups


def version_stats(ro: Rollout, step: int) -> dict:
    """`rollout/versions_per_sample` (distinct weight versions in a response) and `rollout/stale_token_frac` (the
    share of response tokens sampled by weights older than the trained ones, those of update `step`)."""
    versions = [e.versions for e in ro.episodes]
    stale = sum(v < step for vs in versions for v in vs) / max(1, sum(len(vs) for vs in versions))
    return {"rollout/versions_per_sample": float(np.mean([len(set(vs)) for vs in versions])),
            "rollout/stale_token_frac": stale}  # fmt: skip


def start(run: rl.Run, args, train_set: list[dict], refill, cleanup: contextlib.ExitStack, *,
          max_lag: int, partial_rollout: int | None) -> Pipeline:
    """Start the producer thread on rank 0: step t's rollout is `rl.collect_rollout` of the whole batch (through the
    script's refill policy `refill`, as in grpo.py), begun once the engines hold the weights of update
    t − `max_lag` (the script's `--train.max-lag`), with `rollout/lag` (updates between those weights and the trained
    ones) and `perf/gen_s` in its logs. The rollouts a resumed checkpoint carried (`ahead`) come first. The thread
    stops with `cleanup`. The script passes its own knobs as values: core reads none of its fields.

    `partial_rollout` N (the script's `--train.partial-rollout`, lag ≥ 1): from step first + lag on, each step is an
    `interrupted_rollout`, with the sync of the next weights inside it; every episode is a `TaggedEpisode` and the
    logs add `version_stats`."""
    whole = dataclasses.replace(run, world=1)  # rank 0 generates every prompt; the other ranks get the rollout from it
    cut, lag = partial_rollout, max_lag
    if cut is not None and cut < 1:
        raise ValueError(f"--train.partial-rollout {cut}: the first segment must hold at least 1 token")
    if cut is not None and (args.rollout.env_file or args.rollout.agent_file):
        raise ValueError("--train.partial-rollout continues single-turn responses: not with --rollout.env-file or "
                         "--rollout.agent-file")  # fmt: skip

    def produce(step: int, version: int):
        t0, in_flight = time.perf_counter(), pipeline.resumed(step)
        if cut is not None and lag >= 1 and (step - lag >= run.start_step or in_flight is not None):
            ro = interrupted_rollout(whole, args.rollout, cut, train_set, step, version, pipeline, refill, in_flight)
        else:
            ro = rl.collect_rollout(whole, args.rollout, train_set, step, refill)
            ro = ro if cut is None else tag(ro, version)
        gen_s = time.perf_counter() - t0 - ro.logs.get("perf/pause_s", 0.0)
        ro.logs.update({"rollout/lag": step - version, "perf/gen_s": gen_s})
        if cut is not None:
            ro.logs.update(version_stats(ro, step))
        return ro

    pipeline = Pipeline(produce if run.rank == 0 else None, run.start_step, args.train.max_steps, lag,
                        run.client.get("ahead", {}), run.world)  # fmt: skip
    if run.rank == 0:
        pipeline.thread.start()
    cleanup.callback(pipeline.stop)
    run.logger.print(f"[{run.name}] generation runs up to {lag} step(s) ahead of training")
    return pipeline
