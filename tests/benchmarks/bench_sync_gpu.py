"""Weight-sync transports on one GPU: ms per MB from a trainer process to a colocated receiver process.

    python tests/benchmarks/bench_sync_gpu.py                 # a Qwen2-0.5B-shaped payload in bf16, 256 MB buckets

The payload is a Qwen2-0.5B-shaped set of bf16 tensors (24 decoder layers, hidden 896, MLP 4864, vocab 151936: 494 M
parameters, 942 MB) on cuda:0; the receiver (tests/gpu_workers.py) is a second process on the same GPU holding
pre-allocated tensors of the same shapes, as a colocated vLLM engine holds its weights, and copies every bucket into
them. Rows, each timed over the whole payload after one warm-up sync, with the receiver's checksum checked:
- `cuda_ipc`: `core.weight_sync.share_bucket_ipc` -> handles through a queue -> `open_bucket_ipc` (`--vllm.sync-backend
  cuda_ipc`, the colocated path);
- `gloo_host`: each bucket copied to host memory, broadcast over gloo, copied back to the GPU (the CPU path used on a
  GPU: what `broadcast` would cost colocated if NCCL cannot be used);
- `nccl_same_gpu`: the broadcast transport over NCCL with both ranks on one GPU; NCCL refuses that, and the row
  records the error (it needs a second GPU: tests/test_gpu.py::test_nccl_broadcast_moves_buckets_between_two_gpus);
- `d2d_copy`: one device-to-device copy of the payload in one process, the floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (gpu_workers)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo (core)


def qwen2_05b_shapes(layers: int = 24, hidden: int = 896, mlp: int = 4864, vocab: int = 151936, kv: int = 128):
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                   (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "mlp.gate_proj.weight", (mlp, hidden)),
                   (p + "mlp.up_proj.weight", (mlp, hidden)), (p + "mlp.down_proj.weight", (hidden, mlp)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]  # fmt: skip
    return shapes + [("model.norm.weight", (hidden,))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    a = p.parse_args()

    import torch.multiprocessing as mp
    from gpu_workers import buffer_receiver

    from core.engine import free_port
    from core.weight_sync import bucket_named_tensors, flatten_bucket, init_weight_group, send_bucket, share_bucket_ipc

    torch.manual_seed(0)
    named = [(n, torch.randn(s, device="cuda", dtype=torch.bfloat16)) for n, s in qwen2_05b_shapes()]
    mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    expected = sum(t.double().sum().item() for _, t in named)
    spec = [(n, "bfloat16", tuple(t.shape)) for n, t in named]
    print(f"payload: {len(named)} tensors, {sum(t.numel() for _, t in named) / 1e6:.0f} M params, {mb:.0f} MB bf16; "
          f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)  # fmt: skip
    rows = []

    def row(name: str, seconds: list[float] | None, note: str = "") -> None:
        if seconds:
            best = min(seconds)
            r = {"transport": name, "ms": best * 1e3, "ms_per_mb": best * 1e3 / mb, "gb_per_s": mb / 1024 / best,
                 "mb": mb, "bucket_mb": a.bucket_mb, "note": note}  # fmt: skip
            print(f"{name:14s} {r['ms']:9.1f} ms  {r['ms_per_mb']:.4f} ms/MB  {r['gb_per_s']:7.1f} GB/s  {note}")
        else:
            r = {"transport": name, "ms": None, "note": note}
            print(f"{name:14s} {'-':>9s}     {note}")
        rows.append(r)
        sys.stdout.flush()

    ctx = mp.get_context("spawn")

    def receiver():
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=buffer_receiver, args=(spec, inbox, outbox), daemon=True)
        proc.start()
        assert outbox.get(timeout=300) == "ready"
        return proc, inbox, outbox

    def checked(outbox, inbox) -> str:
        inbox.put(("checksum",))
        got = outbox.get(timeout=120)
        return (
            "checksum ok" if abs(got - expected) <= 1e-6 * max(1.0, abs(expected)) else f"CHECKSUM {got} != {expected}"
        )

    # d2d floor
    dest = [torch.empty_like(t) for _, t in named]
    times = []
    for _ in range(a.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, (_, t) in zip(dest, named):
            d.copy_(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    row("d2d_copy", times[1:], "one process, no transport")
    del dest

    # cuda_ipc
    proc, inbox, outbox = receiver()
    times = []
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        for bucket in bucket_named_tensors(named, a.bucket_mb):
            meta, handles, buffers = share_bucket_ipc(bucket, torch.bfloat16, torch.device("cuda"))
            inbox.put(("ipc", meta, handles))
            assert (ans := outbox.get(timeout=120)) == "ok", ans
            del buffers
        times.append(time.perf_counter() - t0)
    row("cuda_ipc", times[1:], checked(outbox, inbox))
    inbox.put(None)
    proc.join(timeout=30)

    # gloo through host memory, then nccl on the same GPU
    for name, backend, device in (("gloo_host", "gloo", "cpu"), ("nccl_same_gpu", "nccl", "cuda:0")):
        proc, inbox, outbox = receiver()
        try:
            port = free_port()
            inbox.put(("group", backend, "127.0.0.1", port, device))
            group = init_weight_group(backend, "127.0.0.1", port, 0, 2, 60)
            assert (ans := outbox.get(timeout=60)) == "joined", ans
            times = []
            for _ in range(a.repeats + 1):
                t0 = time.perf_counter()
                for bucket in bucket_named_tensors(named, a.bucket_mb):
                    meta, flats = flatten_bucket(bucket, torch.bfloat16, torch.device(device))
                    inbox.put(meta)
                    send_bucket(group, flats, 60)
                    assert (ans := outbox.get(timeout=60)) == "ok", ans
                times.append(time.perf_counter() - t0)
            inbox.put(None)
            row(name, times[1:], checked(outbox, inbox))
        except Exception as e:  # noqa: BLE001  (recorded, not hidden: the row says why there is no number)
            row(name, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        finally:
            proc.kill()
            proc.join(timeout=10)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
