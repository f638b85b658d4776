"""The ZeRO-3 weight sync's transfer with and without the gather between the trainer ranks, side by side in one run:
a Qwen2-0.5B-shaped bf16 model on 2 CPU ranks (gloo) sent to a stand-in engine worker (a third process that receives
exactly what a vLLM worker receives, but loads nothing).

    gather: every rank walks `core.weights.full_named_parameters` (one coalesced all-gather per decoder layer), rank 0
            buckets, flattens and broadcasts (`flatten_bucket`, `send_bucket`) over a group of rank 0 and the
            receiver, which takes each bucket with `receive_bucket` (the path before `--vllm.sync-partitions`).
    flat: every rank buckets its own partitions (`core.weights.zero3_partitions`, buckets by full size), flattens them
            into one buffer and sends it point to point over a group of both ranks and the receiver, which receives one
            buffer per rank and concatenates each parameter's pieces (the transport before 2026-11-26's bee3248,
            rebuilt here as `_send_flat` / `_receive_flat`).
    partitions: the same buckets, one message per parameter and rank (`send_partitions`), each received straight into
            its place in the full tensor (`receive_partitions`): no flat buffer, no concatenation.

Buckets of 256 MB (the default `--vllm.sync-bucket-mb`), bf16 on the wire. Each walk is timed from a barrier of all
three processes to the next (the receiver has everything); the median of `--reps` walks after a warm-up, in seconds and
ms per MB of the full size. The receiver checks that both ways deliver identical tensors. Run:

    .venv/bin/python tests/benchmarks/bench_sync_sharded.py              # 24 layers (~2-3 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUCKET_MB = 256.0
TIMEOUT_S = 600.0


def _send_flat(group, bucket, dtype, tag: int) -> None:
    """The previous transport's sending side: this rank's partitions of a bucket (one dtype here) in one buffer."""
    import torch

    flat = torch.cat([p.detach().to(dtype) for _, (p, _) in bucket])
    group.send([flat], 2, tag).wait()


def _receive_flat(group, meta, senders: int, tag: int):
    """The previous transport's receiving side: one buffer per sender, then each parameter's pieces concatenated."""
    import torch

    numels = [int(torch.Size(shape).numel()) for _, _, shape in meta]
    per_rank = [-(-n // senders) for n in numels]
    bufs = [torch.empty(sum(per_rank), dtype=getattr(torch, meta[0][1])) for _ in range(senders)]
    for work in [group.recv([buf], r, tag) for r, buf in enumerate(bufs)]:
        work.wait()
    pieces = [buf.split(per_rank) for buf in bufs]
    return [(name, torch.cat([p[i] for p in pieces])[: numels[i]].view(shape))
            for i, (name, _, shape) in enumerate(meta)]  # fmt: skip


def _config(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip


def _trainer(rank: int, ports: dict, layers: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2ForCausalLM

    from core import engine as ds_engine
    from core import weight_sync, weights
    from core.config import DSConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["world"]), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(layers)).to(torch.bfloat16)
    engine = ds_engine.make_engine(model, DSConfig(zero_stage=3), lr=1e-6)
    one = weight_sync.init_weight_group("gloo", "127.0.0.1", ports["one"], 0, 2, TIMEOUT_S) if rank == 0 else None
    many = weight_sync.init_weight_group("gloo", "127.0.0.1", ports["many"], rank, 3, TIMEOUT_S)
    cpu, dtype = torch.device("cpu"), torch.bfloat16

    def gather() -> None:
        named = weights.full_named_parameters(engine)
        for bucket in weight_sync.bucket_named_tensors(named, BUCKET_MB):
            if rank == 0:
                _, flats = weight_sync.flatten_bucket(bucket, dtype, cpu)
                weight_sync.send_bucket(one, flats, TIMEOUT_S)

    def buckets():
        parts, why = weights.zero3_partitions(engine)
        assert parts is not None, why
        items = [(n, (p, shape)) for n, p, shape in parts]
        size = lambda v: v[1].numel() * v[0].element_size()  # noqa: E731
        return enumerate(weight_sync.bucket_named_tensors(items, BUCKET_MB, nbytes=size))

    def flat() -> None:
        for tag, bucket in buckets():
            _send_flat(many, bucket, dtype, tag)

    def partitions() -> None:
        for tag, bucket in buckets():
            weight_sync.send_partitions(many, bucket, dtype, cpu, [2], tag, TIMEOUT_S)

    ways = {"gather": gather, "flat": flat, "partitions": partitions}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for rep in range(reps + 1):
        for name, walk in ways.items():
            many.barrier().wait()
            t0 = time.perf_counter()
            walk()
            many.barrier().wait()
            if rep:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"seconds": {k: round(statistics.median(v), 3) for k, v in times.items()},
                 "all_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()}})  # fmt: skip
    dist.destroy_process_group()


def _receiver(ports: dict, layers: int, reps: int, out) -> None:
    """The engine worker's side, without vLLM: what `WorkerExtension.cleanrlhf_receive_weights` and
    `cleanrlhf_receive_partitions` receive, before loading."""
    import torch
    from transformers import Qwen2ForCausalLM

    from core import weight_sync

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(_config(layers)).to(torch.bfloat16)
    named = list(model.named_parameters())  # shapes only; tied lm_head is not among them
    metas = [
        [(n, "bfloat16", tuple(t.shape)) for n, t in b] for b in weight_sync.bucket_named_tensors(named, BUCKET_MB)
    ]
    one = weight_sync.init_weight_group("gloo", "127.0.0.1", ports["one"], 1, 2, TIMEOUT_S)
    many = weight_sync.init_weight_group("gloo", "127.0.0.1", ports["many"], 2, 3, TIMEOUT_S)
    cpu = torch.device("cpu")
    first: dict[str, list] = {}
    for rep in range(reps + 1):
        for way in ("gather", "flat", "partitions"):
            many.barrier().wait()
            got = []
            for tag, meta in enumerate(metas):
                if way == "gather":
                    got += weight_sync.receive_bucket(one, meta, cpu, TIMEOUT_S)
                elif way == "flat":
                    got += _receive_flat(many, meta, 2, tag)
                else:
                    got += weight_sync.receive_partitions(many, meta, 2, tag, cpu, TIMEOUT_S)
            many.barrier().wait()
            if not rep:
                first[way] = got
    a = first["gather"]
    same = all([n for n, _ in a] == [n for n, _ in first[w]] and all(torch.equal(x, y) for (_, x), (_, y) in
                                                                       zip(a, first[w])) for w in ("flat", "partitions"))  # fmt: skip
    out.put({"identical": same, "mb": sum(t.numel() * t.element_size() for _, t in a) / 2**20,
             "tensors": len(a), "buckets": len(metas)})  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    opts = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from core.engine import free_port

    ctx = mp.get_context("spawn")
    trainer_out, receiver_out = ctx.Queue(), ctx.Queue()
    ports = {"world": free_port(), "one": free_port(), "many": free_port()}
    procs = [ctx.Process(target=_trainer, args=(r, ports, opts.layers, opts.reps, trainer_out)) for r in range(2)]
    procs.append(ctx.Process(target=_receiver, args=(ports, opts.layers, opts.reps, receiver_out)))
    for p in procs:
        p.start()
    result = {**trainer_out.get(timeout=3600), **receiver_out.get(timeout=600)}
    for p in procs:
        p.join()
    mb = result["mb"]
    print(f"Qwen2-0.5B-shaped, {opts.layers} layers, bf16, {mb:.0f} MB in {result['buckets']} buckets, 2 ZeRO-3 ranks "
          f"-> 1 receiver over gloo; identical tensors: {result['identical']}")  # fmt: skip
    for way, s in result["seconds"].items():
        print(f"  {way:>10}: {s:.3f} s, {1000 * s / mb:.2f} ms/MB  (walks: {result['all_seconds'][way]})")
    print(json.dumps({"bench": "sync_sharded", "layers": opts.layers, **result}))
    return result


if __name__ == "__main__":
    main()
