"""Checkpoint integrity on a tiny DeepSpeed engine (gloo on CPU): every checkpoint carries a manifest of its files'
sizes and hashes; a damaged one (a file deleted, truncated or overwritten) is named in a warning and the newest intact
one resumes; a `latest` pointer naming a missing folder never makes a run start over; no intact checkpoint at all
stops with a message; non-finite parameters are never written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from core import checkpoint
from core import engine as ds_engine
from core.config import DSConfig


def tiny_engine(stage: int = 0):
    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return ds_engine.make_engine(model, DSConfig(zero_stage=stage), 1e-2)


def train_step(engine) -> None:
    x = torch.randn(8, 4)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def two_checkpoints(tmp_path: Path):
    """An engine saved at step 0 and (after one more update) at step 1; returns (engine, ckpt_dir, weights at 0)."""
    engine, ckpt = tiny_engine(), tmp_path / "checkpoints"
    train_step(engine)
    at0 = params(engine)
    checkpoint.save({"model": engine}, ckpt, 0, {"step": 0}, keep_last=3)
    train_step(engine)
    checkpoint.save({"model": engine}, ckpt, 1, {"step": 1}, keep_last=3)
    return engine, ckpt, at0


def model_file(folder: Path) -> Path:
    """The engine's weights file inside a checkpoint folder."""
    (f,) = (folder / "model").glob("*model_states.pt")
    return f


def test_manifest_lists_every_file_and_verify_accepts_an_intact_checkpoint(tmp_path):
    _, ckpt, _ = two_checkpoints(tmp_path)
    folder = ckpt / "step_00000001"
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(e["path"] for e in manifest) == [n for n in on_disk if n != checkpoint.MANIFEST]
    assert "rng_rank0.pt" in on_disk and any(n.startswith("model/") for n in on_disk)
    assert all(len(e["sha256"]) == 64 and e["size"] == (folder / e["path"]).stat().st_size for e in manifest)
    assert checkpoint.verify(folder) is None
    assert checkpoint.latest(ckpt) == folder


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # overwritten in place: same size, other bytes
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["delete", "truncate", "overwrite"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_intact_one(tmp_path, capsys, how):
    engine, ckpt, at0 = two_checkpoints(tmp_path)
    bad = model_file(ckpt / "step_00000001")
    damage(bad, how)
    expected = {"delete": "missing", "truncate": "truncated", "overwrite": "sha256"}[how]

    problem = checkpoint.verify(ckpt / "step_00000001")
    assert problem and str(bad) in problem and expected in problem
    assert checkpoint.latest(ckpt) == ckpt / "step_00000000"
    warning = capsys.readouterr().err
    assert "warning" in warning and str(bad) in warning and expected in warning

    with pytest.raises(ValueError, match=expected) as err:  # loading the damaged one names the file
        checkpoint.load({"model": engine}, ckpt / "step_00000001")
    assert str(bad) in str(err.value)

    client = checkpoint.load({"model": engine}, checkpoint.latest(ckpt))
    assert client["step"] == 0
    for name, value in params(engine).items():
        torch.testing.assert_close(value, at0[name])


def test_a_checkpoint_without_manifest_is_not_intact(tmp_path):
    _, ckpt, _ = two_checkpoints(tmp_path)
    (ckpt / "step_00000001" / checkpoint.MANIFEST).unlink()
    assert "manifest.json: missing" in checkpoint.verify(ckpt / "step_00000001")
    assert checkpoint.latest(ckpt) == ckpt / "step_00000000"


def test_latest_naming_a_missing_folder_resumes_the_newest_intact_one(tmp_path, capsys):
    _, ckpt, _ = two_checkpoints(tmp_path)
    (ckpt / "latest").write_text("step_00000007")  # names a folder that is not there
    assert checkpoint.latest(ckpt) == ckpt / "step_00000001"
    assert "step_00000007, which is missing" in capsys.readouterr().err
    (ckpt / "latest").write_text("step_00000000")  # stale: a kill between the rename and the pointer update
    assert checkpoint.latest(ckpt) == ckpt / "step_00000001"
    (ckpt / "latest").unlink()  # no pointer at all
    assert checkpoint.latest(ckpt) == ckpt / "step_00000001"
    (ckpt / "latest").write_text("step_00000001")
    os.rename(ckpt / "step_00000001", ckpt / "moved")
    assert checkpoint.latest(ckpt) == ckpt / "step_00000000"


def test_no_intact_checkpoint_stops_with_what_is_wrong_with_each(tmp_path):
    _, ckpt, _ = two_checkpoints(tmp_path)
    damage(model_file(ckpt / "step_00000001"), "truncate")
    (ckpt / "step_00000000" / "rng_rank0.pt").unlink()
    with pytest.raises(ValueError, match="no intact checkpoint") as err:
        checkpoint.latest(ckpt)
    msg = str(err.value)
    assert "step_00000001: " in msg and "truncated" in msg
    assert "step_00000000: " in msg and "rng_rank0.pt: missing" in msg

    for folder in ckpt.glob("step_*"):  # the pointer survives, the folders are gone: no silent start over either
        os.rename(folder, tmp_path / folder.name)
    with pytest.raises(ValueError, match="names step_00000001, but .* holds no step_"):
        checkpoint.latest(ckpt)
    (ckpt / "latest").unlink()
    assert checkpoint.latest(ckpt) is None  # nothing there: a new run


def test_a_half_written_save_is_ignored_and_cleaned_by_the_next_save(tmp_path):
    engine, ckpt, _ = two_checkpoints(tmp_path)
    torn = ckpt / ".tmp_step_00000002"
    (torn / "model").mkdir(parents=True)
    (torn / "model" / "half.pt").write_bytes(b"\0" * 10)
    assert checkpoint.latest(ckpt) == ckpt / "step_00000001"
    train_step(engine)
    checkpoint.save({"model": engine}, ckpt, 3, {"step": 3}, keep_last=3)
    assert not list(ckpt.glob(".tmp_*"))
    assert checkpoint.latest(ckpt) == ckpt / "step_00000003"


@pytest.mark.parametrize("stage", [0, 3])
def test_save_refuses_non_finite_parameters(tmp_path, stage):
    engine = tiny_engine(stage)
    train_step(engine)
    p = next(engine.module.parameters())
    with torch.no_grad():  # ZeRO-3: this rank's shard of the parameter
        (p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite weights in the actor after step 5"):
        checkpoint.save({"actor": engine}, tmp_path / "checkpoints", 5, {"step": 5})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"  # torch.save to a full tmpfs


@pytest.mark.parametrize("error", ["torch", "python"])
def test_a_disk_that_fills_during_a_save_is_one_line_with_the_folder_and_free_space(tmp_path, monkeypatch, error):
    """The disk fills while step 2 is written: torch's stream writer raised its bare `RuntimeError: [enforce fail at
    inline_container.cc:672]` (a plain write: OSError ENOSPC). The save ends in one line naming the folder, the free
    space and the intact previous checkpoint; the half-written folder is gone, and the run resumes from step 1. Any
    other error of a write passes unchanged. (Measured on a real full tmpfs, torch 2.10: the same two errors.)"""
    import errno
    import shutil

    engine, ckpt, _ = two_checkpoints(tmp_path)
    at1 = params(engine)
    train_step(engine)
    real_save = torch.save
    fault = RuntimeError(TORCH_FULL_DISK) if error == "torch" else OSError(errno.ENOSPC, "No space left on device")

    def full_disk(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"\0" * 64)  # what fitted before the disk filled
        raise fault

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(OSError) as e:
        checkpoint.save({"model": engine}, ckpt, 2, {"step": 2}, keep_last=3)
    message = str(e.value)
    assert "\n" not in message and e.value.__cause__ is None and e.value.__suppress_context__
    assert f"writing the checkpoint {ckpt / '.tmp_step_00000002'} failed" in message
    assert (TORCH_FULL_DISK if error == "torch" else "No space left on device") in message
    assert "with 0 bytes free on its disk" in message and "step_00000001, took" in message
    assert not list(ckpt.glob(".tmp_*")) and checkpoint.latest(ckpt) == ckpt / "step_00000001"

    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("another fault")))
    with pytest.raises(RuntimeError, match="^another fault$"):  # not taken for a full disk
        checkpoint.save({"model": engine}, ckpt, 2, {"step": 2}, keep_last=3)
    monkeypatch.setattr(torch, "save", real_save)  # space freed: the same run resumes from step 1 and saves again
    assert checkpoint.load({"model": engine}, checkpoint.latest(ckpt))["step"] == 1
    for name, value in params(engine).items():
        torch.testing.assert_close(value, at1[name])
    checkpoint.save({"model": engine}, ckpt, 2, {"step": 2}, keep_last=3)
    assert checkpoint.latest(ckpt) == ckpt / "step_00000002"


def test_a_disk_that_fills_when_latest_moves_names_the_complete_checkpoint(tmp_path, monkeypatch):
    """The checkpoint folder is published and only the `latest` pointer does not fit: one line saying the folder is
    complete, and the next resume takes it (the newest intact one)."""
    import errno

    engine, ckpt, _ = two_checkpoints(tmp_path)
    real_write = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == ".latest.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError, match=r"latest could not be moved to step_00000002 \(No space left on device\)"):
        checkpoint.save({"model": engine}, ckpt, 2, {"step": 2}, keep_last=3)
    assert (ckpt / "latest").read_text() == "step_00000001" and not (ckpt / ".latest.tmp").exists()
    assert checkpoint.latest(ckpt) == ckpt / "step_00000002"
