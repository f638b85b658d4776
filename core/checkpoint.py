"""Resumable checkpoints: DeepSpeed engine state (weights, optimizer, scheduler) + the script's own state (step,
data position, KL controller, ...) + every rank's RNG streams.

Layout: `<dir>/step_00000042/` per checkpoint and `<dir>/latest` naming the newest complete one. A checkpoint is
written as `<dir>/.tmp_step_.../`, renamed when every rank has finished, and only then does `latest` move
(atomically, by `os.replace`): a kill during a save leaves the previous checkpoint as the one that resumes.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(engines: dict, ckpt_dir: str | Path, step: int, client_state: dict, keep_last: int = 2) -> Path:
    """Save every engine in `engines` (name -> DeepSpeed engine, e.g. {"actor": ..., "critic": ...}) plus
    `client_state` and per-rank RNG. Collective: call on every rank."""
    ckpt_dir = Path(ckpt_dir)
    tag = f"step_{step:08d}"
    tmp = ckpt_dir / f".tmp_{tag}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp), tag=name, client_state=client_state if name == next(iter(engines)) else {},
                               save_latest=False)  # fmt: skip
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        final = ckpt_dir / tag
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = ckpt_dir / ".latest.tmp"
        latest_tmp.write_text(tag)
        os.replace(latest_tmp, ckpt_dir / "latest")
        old = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())[:-keep_last] if keep_last > 0 else []
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return ckpt_dir / tag


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.exists():
        return None
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def load(engines: dict, path: str | Path) -> dict:
    """Restore engines (weights, optimizer, scheduler), this rank's RNG, and return the saved client state."""
    path = Path(path)
    client_state: dict = {}
    for i, (name, engine) in enumerate(engines.items()):
        _, state = engine.load_checkpoint(
            str(path), tag=name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if state is None:
            raise ValueError(f"{path}/{name}: not a loadable DeepSpeed checkpoint")
        if i == 0:
            client_state = state
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.exists():
        raise ValueError(f"{rng_file}: missing (checkpoint written with a different world size?)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state
