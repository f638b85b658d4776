"""The optimizers `core.engine.make_engine` hands DeepSpeed other than torch's AdamW: DeepSpeed's FusedAdam on CUDA
(JIT-built, the one whose ZeRO-3 states the hybrid engine can offload) and, for `--ds.optimizer muon`, DeepSpeed's
Muon on the decoder layers' matrices with AdamW on the rest (`muon_split`). Tested with deepspeed 0.19.8.
"""

from __future__ import annotations

import os
import re

import torch

from core.config import DSConfig
from core.weights import LAYER_PREFIX


def fused_adam(params, lr: float, betas: tuple[float, float], weight_decay: float):
    """DeepSpeed's FusedAdam in AdamW mode on CUDA, or None (with the reason printed) where it cannot be built. It is
    JIT-built on first use by ninja + nvcc (cached under ~/.cache/torch_extensions) and is the only optimizer whose
    ZeRO-3 states DeepSpeed can move off the GPU (the hybrid engine, `core.placement.offload_states`)."""
    # DeepSpeed 0.19.8 cannot parse arch names with a suffix (e.g. "10.0a", seen in a CUDA 13 image's
    # TORCH_CUDA_ARCH_LIST): build for the GPUs present instead
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";")
    if any(a and not re.fullmatch(r"\d+\.\d+(\+PTX)?", a) for a in archs):
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{m}.{n}" for m, n in caps)
    try:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, lr=lr, betas=betas, weight_decay=weight_decay, adam_w_mode=True)
    except Exception as e:  # noqa: BLE001  (no nvcc, a failed build: train with torch AdamW instead, and say so)
        print(f"[core.optimizers] DeepSpeed FusedAdam unavailable ({type(e).__name__}: {e}); using torch AdamW, whose "
              "ZeRO-3 optimizer states the hybrid engine cannot offload")  # fmt: skip
        return None


def muon_split(model) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """The trainable parameters as (Muon, AdamW) lists of (name, parameter): the 2-D weight matrices inside the
    decoder layers (`...layers.N....weight`: attention and MLP projections) go to Muon; embeddings, the LM head,
    norms, biases and anything outside the layers (a value head) to AdamW."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if p.ndim == 2 and LAYER_PREFIX.match(name) else adamw).append((name, p))
    return muon, adamw


def _eager_muon_kernels() -> None:
    """DeepSpeed 0.19.8 wraps its Muon update and Newton-Schulz functions in torch.compile, which on CPU compiles C++
    kernels per matrix shape (30-130 s before the first step of the tiny model on 2 cores, for no gain at that size):
    on CPU, put the plain functions back. Every caller imports them from `original_muon` when it runs, except
    `muon_optimizer`, which holds its own reference."""
    from deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    for name in ("muon_update", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
        fn = getattr(original_muon, name)
        setattr(original_muon, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    muon_optimizer.muon_update = original_muon.muon_update


def muon_optimizer(model, ds: DSConfig, lr: float, betas: tuple[float, float], weight_decay: float):
    """DeepSpeed's `MuonWithAuxAdam` as a client optimizer: Muon at `ds.muon_lr` on `muon_split`'s matrices (each
    tagged `use_muon`, the flag DeepSpeed's ZeRO optimizers read to gather a partitioned matrix whole before
    orthogonalising it), torch AdamW at `lr` on the rest. Tested with deepspeed 0.19.8 at ZeRO 0/2/3, one and two
    ranks, fp32 and bf16, with and without optimizer offload: the same weights as ZeRO-0 within float rounding."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    if hasattr(model, "peft_config"):
        raise ValueError("--ds.optimizer muon with --model.lora-rank > 0: Muon orthogonalises whole weight matrices; "
                         "LoRA's low-rank factors are not those. Use --ds.optimizer adamw with LoRA")  # fmt: skip
    if not torch.cuda.is_available():
        _eager_muon_kernels()
    muon, adamw = muon_split(model)
    for _, p in muon:
        p.use_muon = True
    for _, p in adamw:
        p.use_muon = False
    groups = [dict(params=[p for _, p in muon], use_muon=True, lr=ds.muon_lr, momentum=ds.muon_momentum,
                   weight_decay=weight_decay),
              dict(params=[p for _, p in adamw], use_muon=False, lr=lr, betas=betas, eps=1e-8,
                   weight_decay=weight_decay)]  # fmt: skip
    return MuonWithAuxAdam([g for g in groups if g["params"]], adam_optimizer=torch.optim.AdamW)
