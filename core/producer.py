"""Generation running ahead of training (algos/grpo_async.py): rank 0's producer thread asks the vLLM engines (Ray
actors, their own processes) for step t+1's rollout while the training loop trains on step t's.

    pipeline = producer.start(run, args, train_set, keep, cleanup)   # the thread starts; `cleanup` stops it
    for step in ...:
        ro = pipeline.take(step)                  # step t's rollout, sampled by the weights of update t − L
        ... update ...
        ahead = pipeline.engines_idle_for(step)   # the engines are idle: sync the weights, eval, checkpoint `ahead`
        pipeline.synced_update(step)              # the engines hold the new weights: the producer goes on

Which weights sample which step is fixed by `--train.max-lag` L, not by the threads' timing (see `Pipeline`), so a
run is reproducible, and a checkpoint that carries the rollouts generated ahead resumes exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time

import torch

from core import placement, rl, rollout
from core.placement import all_ranks


class Pipeline:
    """The hand-off between the producer thread (rank 0), which generates rollouts, and the training loop.

    `synced` counts the updates whose weights are in the engines; `ready[t]` holds step t's rollout once generated.
    The producer starts step t when synced >= t − lag; the trainer syncs update u + 1 only after every step up to
    u + lag is generated. Together: step t is sampled by exactly the weights of update max(t − lag, first step), and
    the engines never generate during a sync or an eval. Errors of the producer are raised in the trainer.

    `produce(step, version) -> rollout` runs in the thread (`thread.start()` starts it); `carried` holds rollouts
    generated before (a checkpoint's), trained first. With `world` > 1 the ranks > 0 pass `produce` None (no thread)
    and `take` gives them rank 0's rollouts (a broadcast: every rank calls it)."""

    def __init__(self, produce, first: int, last: int, lag: int, carried: dict, world: int = 1):
        self.produce, self.last, self.lag, self.world = produce, last, lag, world
        self.synced, self.ready, self.error, self.stopped = first, dict(carried), None, False
        self.generated = first + len(carried)  # steps < generated are in `ready` or already trained on
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
        """Wait until every rollout that the weights before update t + 1 must sample is generated; the engines are
        then idle until `synced_update(t)`. Returns those rollouts (steps t + 1 .. t + lag), which a checkpoint keeps
        ({} on the ranks > 0)."""
        if self.produce is None:
            return {}
        self._wait(lambda: self.generated >= min(t + self.lag + 1, self.last))
        with self.cond:
            return dict(self.ready)

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


def start(run: rl.Run, args, train_set: list[dict], keep, cleanup: contextlib.ExitStack) -> Pipeline:
    """Start the producer thread on rank 0: step t's rollout is `rl.collect_rollout` of the whole batch (DAPO refills
    by `keep`, as in grpo.py), begun once the engines hold the weights of update t − `--train.max-lag`, with
    `rollout/lag` (updates between those weights and the trained ones) and `perf/gen_s` in its logs. The rollouts a
    resumed checkpoint carried (`ahead`) come first. The thread stops with `cleanup`."""
    whole = dataclasses.replace(run, world=1)  # rank 0 generates every prompt; the other ranks get the rollout from it

    def produce(step: int, version: int):
        t0 = time.perf_counter()
        ro = rl.collect_rollout(whole, args, train_set, step, keep=keep)
        ro.logs.update({"rollout/lag": step - version, "perf/gen_s": time.perf_counter() - t0})
        return ro

    pipeline = Pipeline(produce if run.rank == 0 else None, run.start_step, args.train.max_steps, args.train.max_lag,
                        run.client.get("ahead", {}), run.world)  # fmt: skip
    if run.rank == 0:
        pipeline.thread.start()
    cleanup.callback(pipeline.stop)
    run.logger.print(f"[{run.name}] generation runs up to {args.train.max_lag} step(s) ahead of training")
    return pipeline
