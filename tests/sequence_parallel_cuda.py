"""Ulysses attention on one CUDA GPU, in a world of one over NCCL (the all-to-all is then an exchange with itself):
sdpa's CUDA kernels with the packed rows' boolean mask and with is_causal, GQA, against plain sdpa, outputs and q/k/v
gradients, fp32 and bf16. It imports torch and core/sequence_parallel.py only (a GPU machine without the rest of the
stack can run it). What it does not check: an exchange between GPUs (one GPU cannot hold two NCCL ranks).

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/sequence_parallel_cuda.py out.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core import sequence_parallel as sp  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    group = dist.new_group([0])
    worst: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, pos in ((4, 4, [*range(100), *range(90), *range(66)]), (8, 2, [*range(256)])):
            torch.manual_seed(heads)
            q, k, v = (torch.randn(1, h, 256, 64, device="cuda", dtype=dtype, requires_grad=True)
                       for h in (heads, kv_heads, kv_heads))  # fmt: skip
            mask = sp.block_causal_mask(torch.tensor([pos], device="cuda"))
            k_full, v_full = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask,
                                                                   is_causal=mask is None)  # fmt: skip
            ref.float().pow(2).sum().backward()
            ref_grads = [x.grad.clone() for x in (q, k, v)]
            for x in (q, k, v):
                x.grad = None
            got, _ = sp.ulysses_attention(None, q, k, v, None, scaling=64**-0.5, sp_group=group, sp_mask=mask)
            got.float().pow(2).sum().backward()
            diffs = [(got - ref.transpose(1, 2)).abs().max().item()]
            diffs += [(x.grad - g).abs().max().item() for x, g in zip((q, k, v), ref_grads)]
            worst[f"{dtype}, {heads}/{kv_heads} heads, mask {mask is not None}"] = max(diffs)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "max_diff": worst}, f, indent=1)
    print(json.dumps(worst, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
