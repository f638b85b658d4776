"""Weight transfer from the trainer to the engines, with torch alone (no vLLM): the trainer's (name, tensor) pairs cut
into buckets that never split a decoder layer, and the three transports that carry a bucket across processes:
a broadcast over a process group of the trainer and the engine workers, point-to-point partitions from every rank of
a ZeRO-3 trainer, and CUDA IPC handles for an engine on the trainer's GPU. `core.rollout.RolloutEngines` sends with
these functions, the engine workers (`core.vllm_engine.WorkerExtension`) receive with them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

Named = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------------------------
# Weight buckets (pure; no vLLM)


LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _group_key(name: str) -> str:
    """Parameters that vLLM may fuse or process together: a whole decoder layer (`...layers.N.`), else the parent
    module of the parameter's module (`model.embed_tokens.weight` -> `model`)."""
    m = LAYER.match(name)
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
    rank order and cut to n are the flattened parameter (DeepSpeed's ZeRO-3 layout, `core.weights.zero3_partitions`):
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
