"""Processes on the other side of a GPU weight transport, for tests/test_gpu.py and tests/benchmarks/bench_sync_gpu.py.

Each runs in a spawned process on the same GPU as the sender and stands where a colocated vLLM engine would: it
holds its own copy of the weights, loads every bucket it is sent, and answers over a queue. Plain functions at module
level, so `multiprocessing`'s spawn can import them in the child.
"""

from __future__ import annotations

import torch


def model_receiver(model_dir: str, inbox, outbox) -> None:
    """A replica of the causal LM in `model_dir` on cuda:0. Messages: ("bucket", meta, handles) -> load it through
    CUDA IPC, answer the number of tensors; ("logprobs", token_ids) -> answer the replica's per-token log-probs (CPU);
    None -> stop."""
    from transformers import AutoModelForCausalLM

    from core.packing import collate_padded, token_logprobs
    from core.weight_sync import open_bucket_ipc

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    params = dict(model.named_parameters())
    outbox.put("ready")
    while (msg := inbox.get()) is not None:
        try:
            if msg[0] == "bucket":
                named = open_bucket_ipc(msg[1], msg[2])
                with torch.no_grad():
                    for name, tensor in named:
                        params[name].copy_(tensor)
                torch.cuda.synchronize()  # done reading the sender's memory before answering
                del named
                outbox.put(len(msg[1]))
            elif msg[0] == "logprobs":
                batch = collate_padded([{"input_ids": t, "loss_mask": [0] * len(t)} for t in msg[1]], 0, "cuda")
                with torch.no_grad():
                    outbox.put(token_logprobs(model, batch).float().cpu())
        except Exception as e:  # the test reports it; the process must not die silently
            outbox.put(repr(e))


def buffer_receiver(spec: list[tuple[str, str, tuple[int, ...]]], inbox, outbox) -> None:
    """Pre-allocated destination tensors of `spec` (name, dtype, shape) on cuda:0, like an engine's weights. Messages:
    ("ipc", meta, handles) -> copy a bucket from CUDA IPC; ("gloo", meta, addr, port) -> join a 2-rank gloo group
    and receive buckets as `core.weight_sync.receive_bucket` until told to stop; ("checksum",) -> the float64 sum of
    every destination tensor; None -> stop. Answers "ok" after each bucket."""
    from core.weight_sync import open_bucket_ipc

    dest = {n: torch.zeros(shape, dtype=getattr(torch, d), device="cuda") for n, d, shape in spec}
    outbox.put("ready")
    while (msg := inbox.get()) is not None:
        try:
            if msg[0] == "ipc":
                for name, tensor in open_bucket_ipc(msg[1], msg[2]):
                    dest[name].copy_(tensor)
                torch.cuda.synchronize()
                outbox.put("ok")
            elif msg[0] == "group":  # (kind, backend, addr, port, device): join, then receive bucket metas by queue
                from core.weight_sync import init_weight_group, receive_bucket

                _, backend, addr, port, device = msg
                group = init_weight_group(backend, addr, port, 1, 2, 120)
                outbox.put("joined")
                while (meta := inbox.get()) is not None:
                    for name, tensor in receive_bucket(group, meta, torch.device(device), 120):
                        dest[name].copy_(tensor, non_blocking=False)
                    torch.cuda.synchronize()
                    outbox.put("ok")
            elif msg[0] == "checksum":
                outbox.put(sum(t.double().sum().item() for t in dest.values()))
        except Exception as e:
            outbox.put(repr(e))
