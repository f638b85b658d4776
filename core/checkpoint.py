"""Resumable checkpoints: DeepSpeed engine state (weights, optimizer, scheduler) + the script's own state (step,
data position, KL controller, ...) + every rank's RNG streams.

Layout: `<dir>/step_00000042/` per checkpoint and `<dir>/latest` naming the newest complete one. A checkpoint is
written as `<dir>/.tmp_step_.../`, gets a `manifest.json` (every file's path, size and sha256) as its last file when
every rank has finished, is renamed, and only then does `latest` move (atomically, by `os.replace`): a kill during a
save leaves the previous checkpoint as the one that resumes, and its leftover `.tmp_*` folder is removed by the next
save. On resume the newest checkpoint whose files match its manifest is used (`latest`); a damaged one (a file
deleted, truncated or overwritten) is named in a warning and skipped, and if none is intact the run stops instead of
starting over.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from core import engine as ds_engine
from core import models
from core.ema import ema_init
from core.placement import ModelGroup
from core.weights import ep_size, tp_size

MANIFEST = "manifest.json"


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _warn(msg: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] warning: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | Path) -> Path:
    """Write `<folder>/manifest.json`: every other file's relative path, size and sha256 (hashed in threads; hashlib
    releases the GIL on large buffers)."""
    folder = Path(folder)
    files = _files(folder)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_sha256, files))
    entries = [{"path": f.relative_to(folder).as_posix(), "size": f.stat().st_size, "sha256": d}
               for f, d in zip(files, digests)]  # fmt: skip
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


_intact: dict[str, tuple] = {}  # folder -> (path, size, mtime) of its files when last verified intact


def _stat_key(folder: Path) -> tuple:
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file())


def verify(path: str | Path) -> str | None:
    """None when every file in the manifest of checkpoint folder `path` is there with its recorded size and sha256;
    else a message naming what is wrong (the folder or manifest missing, a file missing, of the wrong size or with
    the wrong hash). Files not in the manifest are ignored. An intact result is remembered until a file changes."""
    path = Path(path)
    if not path.is_dir():
        return f"{path}: folder missing"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest}: missing (an incomplete checkpoint, or one written before manifests)"
    key = _stat_key(path)
    if _intact.get(str(path)) == key:
        return None
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest}: unreadable ({e})"
    for e in entries:  # cheap checks first
        f = path / e["path"]
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != e["size"]:
            return f"{f}: {f.stat().st_size} bytes, the manifest says {e['size']} (truncated or overwritten)"
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_sha256, [path / e["path"] for e in entries]))
    for e, d in zip(entries, digests):
        if d != e["sha256"]:
            return f"{path / e['path']}: sha256 differs from the manifest (overwritten or corrupted)"
    _intact[str(path)] = key
    return None


def save(engines: dict, ckpt_dir: str | Path, step: int, client_state: dict, keep_last: int = 2) -> Path:
    """Save every engine in `engines` (name -> DeepSpeed engine, e.g. {"actor": ..., "critic": ...}, or a
    `ModelGroup` holding it in a group of its own, whose ranks save it) plus `client_state` and per-rank RNG. Raises FloatingPointError naming the engine, writing nothing, when a parameter
    on any rank is NaN/inf. Collective: call on every rank."""
    ckpt_dir = Path(ckpt_dir)
    groups = {name: e for name, e in engines.items() if isinstance(e, ModelGroup)}  # models in groups of their own
    engines = {name: e for name, e in engines.items() if name not in groups}
    rank = _rank()
    for name, engine in engines.items():  # no checkpoint ever holds NaN/inf weights
        ds_engine.check_weights_finite(engine, step, name)
    if rank == 0:
        for name, group in groups.items():
            group.run(_group_check_finite, step, name)
    tag = f"step_{step:08d}"
    tmp = ckpt_dir / f".tmp_{tag}"
    try:
        if rank == 0:
            for leftover in ckpt_dir.glob(".tmp_step_*"):  # from a kill during an earlier save
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        for name, engine in engines.items():
            engine.save_checkpoint(str(tmp), tag=name, client_state=client_state if name == next(iter(engines)) else {},
                                   save_latest=False)  # fmt: skip
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        for name, engine in engines.items():  # `--actor.ema-beta`: this rank's part of the moving average
            if getattr(engine, "ema", None) is not None:
                torch.save(engine.ema, tmp / f"ema_{name}_rank{rank}.pt")
        if rank == 0:  # a group's ranks save its engine under its name (they draw no random numbers: no RNG files)
            for name, group in groups.items():
                group.run(_group_save, str(tmp), name)
        _barrier()
        if rank == 0:
            write_manifest(tmp)  # last: a folder with a manifest is complete
    except (OSError, RuntimeError) as e:
        if (reason := _write_failure(e)) is None:
            raise
        raise OSError(_no_room(ckpt_dir, tmp, reason)) from None
    if rank == 0:
        final = ckpt_dir / tag
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = ckpt_dir / ".latest.tmp"
        try:
            latest_tmp.write_text(tag)
        except OSError as e:  # the folder is published and intact: resume takes it, as the newest intact one
            if (reason := _write_failure(e)) is None:
                raise
            latest_tmp.unlink(missing_ok=True)
            free = _size(shutil.disk_usage(ckpt_dir).free)
            raise OSError(f"{ckpt_dir / 'latest'} could not be moved to {tag} ({reason}) with {free} free on its "
                          f"disk; {final} is complete and intact: free space on that disk and run the same command "
                          "again to resume from it") from None  # fmt: skip
        os.replace(latest_tmp, ckpt_dir / "latest")
        old = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())[:-keep_last] if keep_last > 0 else []
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return ckpt_dir / tag


def _write_failure(e: BaseException) -> str | None:
    """What went wrong when a checkpoint write failed for want of room, None for any other error: an OSError of a full
    disk or quota (Python's and DeepSpeed's writes), or the RuntimeError of torch's stream writer, which says nothing
    of the disk (`[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534`: `torch.save` to a full
    tmpfs, torch 2.10)."""
    if isinstance(e, OSError):
        return e.strerror or str(e) if e.errno in (errno.ENOSPC, errno.EDQUOT) else None
    lines = [line for line in str(e).splitlines() if "inline_container.cc" in line or "PytorchStreamWriter" in line]
    return f"torch: {lines[0].strip()}" if isinstance(e, RuntimeError) and lines else None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def _no_room(ckpt_dir: Path, tmp: Path, reason: str) -> str:
    """One line for a checkpoint write that failed (`_write_failure`): the folder, the free space on its disk, what
    the previous checkpoint took, and that the run resumes from it; the half-written `tmp` is removed."""
    folder = next(p for p in (tmp, *tmp.parents) if p.exists())
    free = shutil.disk_usage(folder).free
    shutil.rmtree(tmp, ignore_errors=True)  # never resumed from; its space is better given back at once
    previous = _step_folders(ckpt_dir) if ckpt_dir.is_dir() else []
    size = sum(f.stat().st_size for f in previous[0].rglob("*") if f.is_file()) if previous else 0
    before = f"the previous one, {previous[0].name}, took {_size(size)} and is intact" if previous else \
        "there is no earlier checkpoint"  # fmt: skip
    return (f"writing the checkpoint {tmp} failed ({reason}) with {_size(free)} free on its disk; the "
            f"partial folder is removed and {before}: free space on the disk of {ckpt_dir} (or keep fewer checkpoints, "
            "--ckpt.keep-last) and run the same command again to resume")  # fmt: skip


def _step_folders(ckpt_dir: Path) -> list[Path]:
    """`step_<n>` folders, newest first (`.tmp_step_*` leftovers of a killed save are not among them)."""
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest intact checkpoint folder, or None when `ckpt_dir` holds none at all. A damaged newer one (or a
    `latest` pointer naming a missing or damaged folder) gives a warning naming the bad file and the next newest intact
    one is used. Raises ValueError, listing what is wrong with each, when checkpoints exist but none is intact."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else None
    folders = _step_folders(ckpt_dir)
    if not folders:
        if named:
            raise ValueError(f"{pointer} names {named}, but {ckpt_dir} holds no step_* checkpoint folder; restore it, "
                             f"or delete {pointer} (or pass --ckpt.no-resume) to start over")  # fmt: skip
        return None
    if named and not (ckpt_dir / named).is_dir():
        _warn(f"{pointer} names {ckpt_dir / named}, which is missing")
    problems = []
    for folder in folders:
        err = verify(folder)
        if err is None:
            if problems or (named and named != folder.name):
                _warn(f"resuming from {folder} (the newest intact checkpoint), not {ckpt_dir / (named or '?')}")
            return folder
        _warn(f"damaged checkpoint {folder}: {err}")
        problems.append(f"  {folder.name}: {err}")
    raise ValueError(f"no intact checkpoint in {ckpt_dir} to resume from:\n" + "\n".join(problems) +
                     "\nrestore or remove the damaged folders, or pass --ckpt.no-resume to start over")  # fmt: skip


def load(engines: dict, path: str | Path) -> dict:
    """Restore engines (weights, optimizer, scheduler), this rank's RNG, and return the saved client state. Raises
    ValueError naming the bad file when the checkpoint does not match its manifest."""
    path = Path(path)
    err = verify(path)
    if err is not None:
        raise ValueError(f"damaged checkpoint {path}: {err}")
    client_state: dict = {}
    for i, (name, engine) in enumerate(engines.items()):
        if isinstance(engine, ModelGroup):  # a model in a group of its own: its ranks load it, asked by rank 0
            state = engine.run(_group_load, str(path), name)[0] if _rank() == 0 else {}
        else:
            # a 4-bit base (QLoRA) saves bitsandbytes' quantization state beside each weight, keys torch's loader
            # does not take back; that base is frozen and loads again from the model as it was quantized
            strict = not models.is_4bit(engine)
            _check_tp_size(engine, path / name)
            _check_expert_parallel(engine, path / name)
            _, state = engine.load_checkpoint(
                str(path), tag=name, load_optimizer_states=True, load_lr_scheduler_states=True,
                load_module_strict=strict,
            )  # fmt: skip
        if state is None:
            raise ValueError(f"{path}/{name}: not a loadable DeepSpeed checkpoint")
        _load_ema(engine, path, name)
        if i == 0:
            client_state = state
    rng_file = path / f"rng_rank{_rank()}.pt"
    if not rng_file.exists():
        raise ValueError(f"{rng_file}: missing (checkpoint written with a different world size?)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def _check_tp_size(engine, folder: Path) -> None:
    """Refuse to load a checkpoint saved at another `--ds.tensor-parallel-size` than `engine`'s. DeepSpeed 0.19.8 writes
    one `[zero_pp_rank_<d>_]mp_rank_<t>_model_states.pt` per tensor-parallel rank t, holding that rank's shards, and
    does not reshard them: a TP 2 checkpoint resumed at TP 1 ended in its `AssertionError: key ... is not found in the
    checkpoint`."""
    saved = {f.name.rsplit("mp_rank_", 1)[1].split("_")[0] for f in folder.glob("*mp_rank_*_model_states.pt")}
    if saved and len(saved) != tp_size(engine):
        raise ValueError(f"{folder}: saved with --ds.tensor-parallel-size {len(saved)}, resumed with "
                         f"{tp_size(engine)}; --ckpt.allow-changes cannot change it (DeepSpeed does not "
                         f"reshard an AutoTP checkpoint): resume with --ds.tensor-parallel-size {len(saved)}, or start "
                         "over (--ckpt.no-resume or another --run-dir)")  # fmt: skip


def _check_expert_parallel(engine, folder: Path) -> None:
    """Refuse to load a checkpoint saved at another `--ds.expert-parallel-size` than `engine`'s. DeepSpeed 0.19.8
    records each AutoEP layer's `ep_size` in the model states (`ds_autoep_layers`), saves the rest of the model under
    AutoEP's own module names (`mlp.router.gate`, `mlp.shared_experts`), which the HF blocks of a model without AutoEP
    do not have, and the experts either one file per (layer, expert) at ZeRO 0-2 or inside ZeRO-3's partitions of
    the saved expert-parallel layout."""
    states = sorted(f for f in folder.glob("*mp_rank_00_model_states.pt") if not f.name.startswith("layer_"))
    if not states:
        return
    saved = torch.load(states[0], map_location="cpu", mmap=True, weights_only=False).get("ds_autoep_layers") or []
    size = max((layer["ep_size"] for layer in saved), default=1)
    if size != ep_size(engine):
        raise ValueError(f"{folder}: saved with --ds.expert-parallel-size {size}, resumed with {ep_size(engine)}; "
                         "--ckpt.allow-changes cannot change it (DeepSpeed AutoEP's checkpoint names its layers and "
                         f"places its experts its own way): resume with --ds.expert-parallel-size {size}, or start "
                         "over (--ckpt.no-resume or another --run-dir)")  # fmt: skip


def _load_ema(engine, path: Path, name: str) -> None:
    """Restore this rank's part of an engine's EMA (`core.ema.ema_init`); a checkpoint saved without one (EMA
    turned on at resume, with --ckpt.allow-changes) starts it at the restored weights, with a warning."""
    if getattr(engine, "ema", None) is None:
        return
    f = path / f"ema_{name}_rank{_rank()}.pt"
    if f.exists():
        engine.ema = {k: v.to(engine.ema[k].device) for k, v in torch.load(f, weights_only=True).items()}
        return
    _warn(f"{f}: missing (saved without --actor.ema-beta): the EMA of the {name} starts at the restored weights")
    ema_init(engine, engine.ema_beta)


def _group_check_finite(worker, step: int, name: str) -> None:
    ds_engine.check_weights_finite(worker.engine, step, name)


def _group_save(worker, folder: str, name: str) -> None:
    worker.engine.save_checkpoint(folder, tag=name, client_state={}, save_latest=False)


def _group_load(worker, folder: str, name: str) -> dict | None:
    _, state = worker.engine.load_checkpoint(folder, tag=name, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)  # fmt: skip
    return state


def refuse_finished(run_dir: str | Path, ckpt_dir: str | Path, max_steps: int, resume: bool = True) -> None:
    """Refuse a folder whose run finished (`summary.json`, not halted, all `max_steps` done) while its newest
    checkpoint is older (`--train.halt-after` jobs with `--ckpt.every 0`): resuming would train the last segment
    again. Say that it is finished instead. An unreadable summary.json is named (ValueError). Reads only: callable
    on every rank."""
    from core.logger import read_json

    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    summary = run_dir / "summary.json"
    if not resume or not summary.is_file():  # --ckpt.no-resume: a new run, the old files move aside
        return
    done = read_json(summary, f"it says whether the run in {run_dir} finished: delete it to resume the run from its "
                              "newest checkpoint, or give another --run-dir")  # fmt: skip
    if not isinstance(done, dict):
        return
    newest = latest(ckpt_dir) if ckpt_dir.is_dir() else None
    if done.get("halted") or done.get("steps") != max_steps or newest is None or int(newest.name[5:]) + 1 >= max_steps:
        return
    raise ValueError(f"{run_dir} holds a finished run of {max_steps} steps (summary.json; its model is in "
                     f"{run_dir / 'hf'}): nothing to resume, and its newest checkpoint ({newest.name}) is older, so "
                     "resuming would train its last steps again. Give another --run-dir for a new run.")  # fmt: skip


def resume(engines: dict, ckpt_dir: str | Path, run_dir: str | Path, args) -> tuple[int, dict]:
    """The scripts' resume: with `--ckpt.resume` and an intact checkpoint in `ckpt_dir`, refuse a finished run whose
    newest checkpoint is older (`refuse_finished`), check the flags against the run's saved config
    (`core.logger.check_config`: a run-altering change needs `--ckpt.allow-changes`), restore the engines and RNG,
    and return (first step to run, saved client state); else (0, {}). Collective: every rank calls it."""
    from core.logger import check_config

    if not args.ckpt.resume:
        return 0, {}
    path = latest(ckpt_dir)
    if path is None:
        return 0, {}
    refuse_finished(run_dir, ckpt_dir, args.train.max_steps)
    check_config(run_dir, args)
    client = load(engines, path)
    start_step = client["step"] + 1
    if _rank() == 0:
        print(f"[checkpoint] resumed from {path} at step {start_step}", flush=True)
    return start_step, client
