"""An exponential moving average of a DeepSpeed engine's trained weights (`--actor.ema-beta`): fp32 copies
of what each rank holds (its ZeRO-3 partition only, never a full copy), kept on the engine. `core.engine.make_engine`
starts it, `core.engine.optimizer_step` updates it after every step, `core.checkpoint` saves and restores it and
`core.engine.export_hf(..., ema=True)` exports it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def local_weights(engine) -> dict[str, torch.Tensor]:
    """The trainable weights this rank holds, by name: under ZeRO-3 its flat partition (`ds_tensor`), else the
    tensors themselves (the engine's module weights; a bf16 model's are bf16 copies of DeepSpeed's fp32 masters)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p.data
    return out


def ema_init(engine, beta: float) -> None:
    """Start an exponential moving average of `engine`'s trainable weights at their current values: `engine.ema`
    holds fp32 copies of what this rank holds (ZeRO-3: its partition only, never a full copy), `engine.ema_beta` β.
    `optimizer_step` updates it, `core.checkpoint` saves and restores it, `export_hf(..., ema=True)` exports it."""
    engine.ema_beta = beta
    engine.ema = {k: v.detach().float().clone() for k, v in local_weights(engine).items()}


@torch.no_grad()
def ema_update(engine) -> None:
    """ema ← β·ema + (1 − β)·θ for every trainable weight θ this rank holds; no-op without an EMA."""
    ema = getattr(engine, "ema", None)
    if ema is None:
        return
    for name, w in local_weights(engine).items():
        ema[name].lerp_(w.float(), 1.0 - engine.ema_beta)


@contextmanager
def ema_weights(engine):
    """Within the block the engine's module holds the EMA weights (each rank its own part); the trained weights are
    put back after, bit for bit. Only reads of the module (export, eval) belong inside."""
    local = local_weights(engine)
    saved = {k: v.detach().clone() for k, v in local.items()}
    try:
        with torch.no_grad():
            for k, v in local.items():
                v.copy_(engine.ema[k])
        yield engine
    finally:
        with torch.no_grad():
            for k, v in local.items():
                v.copy_(saved[k])
