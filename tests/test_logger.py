"""Run records across a resume: metrics.jsonl and TensorBoard hold every step once (the killed run's rows past the
checkpoint are dropped, the step-0 eval is not logged again), the history behind `latest()` / `plot()` covers the
whole run, a new run never appends to an old run's files, and a resume with run-altering flags is refused unless
`--ckpt.allow-changes`, which is recorded while `config.json` keeps the original flags. A run folder has one
writer: a second run on a folder in use is refused before it moves or writes anything, and a killed run's lock is
taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from core import checkpoint
from core.config import LoggerConfig
from core.logger import RunDirLocked, RunLogger, check_config, config_changes, lock_run_dir

ROOT = Path(__file__).resolve().parents[1]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


CONFIG = {"train": {"lr": 1e-3, "halt_after": None}, "logger": {"quiet": True}, "ckpt": {"allow_changes": False}}


def changed(config: dict, **sections) -> dict:
    return {k: {**v, **sections.get(k, {})} for k, v in config.items()}


def tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def purge_markers(tb_dir: Path) -> list[int]:
    """Steps of the SessionLog START events that tell TensorBoard to drop older events from that step on."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    return [e.step for f in sorted(tb_dir.glob("events.*")) for e in EventFileLoader(str(f)).Load()
            if e.HasField("session_log") and e.session_log.status == SessionLog.START]  # fmt: skip


def test_resume_cuts_the_killed_runs_rows_and_keeps_the_history(tmp_path):
    cfg = LoggerConfig(quiet=True, tensorboard=True)
    first = RunLogger(cfg, tmp_path, CONFIG, 10)
    for step in range(7):  # the killed run got to step 6; its last checkpoint is at step 4
        first.log({"loss/x": step, **({"eval/acc": step / 10} if step % 2 == 0 else {})}, step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss/')  # a line torn by the kill

    resumed = RunLogger(cfg, tmp_path, CONFIG, 10, resume_step=4)
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2, 3, 4]
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3, 4]
    assert resumed.latest("loss/x") == 4 and resumed.latest("eval/acc") == pytest.approx(0.4)
    for step in range(5, 9):
        resumed.log({"loss/x": 10 * step}, step)
    resumed.plot(tmp_path / "learning_curve.png", ("loss/x", "eval/acc"))
    resumed.close()

    steps = [r["step"] for r in rows(tmp_path)]
    assert steps == list(range(9))
    assert [h["step"] for h in resumed.history] == steps  # the learning curve covers the whole run
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
    assert {r["step"]: r["loss/x"] for r in rows(tmp_path)}[6] == 60
    assert 5 in purge_markers(tmp_path / "tb")  # TensorBoard drops the killed run's events from step 5 on
    assert tb_scalars(tmp_path / "tb", "loss/x") == [(s, s if s <= 4 else 10 * s) for s in range(9)]
    assert [s for s, _ in tb_scalars(tmp_path / "tb", "eval/acc")] == [0, 2, 4]


def test_a_new_run_in_an_old_run_folder_moves_the_old_files_aside(tmp_path, capsys):
    cfg = LoggerConfig(quiet=True, tensorboard=True)
    old = RunLogger(cfg, tmp_path, CONFIG, 10)
    old.log({"loss/x": 1.0}, 1)
    old.close()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "notes.txt").write_text("mine")

    new = RunLogger(cfg, tmp_path, changed(CONFIG, train={"lr": 5e-3}), 10)  # step 0: not a resume
    new.log({"loss/x": 2.0}, 0)
    new.close()
    (aside,) = tmp_path.glob("previous_*")
    assert f"moved to {aside}" in capsys.readouterr().err
    assert [r["step"] for r in rows(aside)] == [1] and [r["step"] for r in rows(tmp_path)] == [0]
    assert (aside / "tb").is_dir() and (aside / "checkpoints").is_dir() and (aside / "summary.json").is_file()
    assert json.loads((aside / "config.json").read_text())["train"]["lr"] == 1e-3
    assert json.loads((tmp_path / "config.json").read_text())["train"]["lr"] == 5e-3
    assert (tmp_path / "notes.txt").read_text() == "mine"  # not a run file: left alone


def test_config_changes_name_every_flag_and_refuse_run_altering_ones(tmp_path):
    now = changed(CONFIG, train={"lr": 2e-3, "halt_after": 3}, logger={"quiet": False})
    now["data"] = {"path": "x"}  # a flag the saved run did not have
    changes = {c["flag"]: c for c in config_changes(CONFIG, now)}
    assert set(changes) == {"--train.lr", "--train.halt-after", "--logger.quiet", "--data.path"}
    assert not changes["--train.lr"]["harmless"] and not changes["--data.path"]["harmless"]
    assert changes["--train.halt-after"]["harmless"] and changes["--logger.quiet"]["harmless"]

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match="--ckpt.allow-changes") as err:
        check_config(tmp_path, now)
    msg = str(err.value)
    assert "--train.lr: 0.001 -> 0.002" in msg and "--data.path: <absent> -> x" in msg
    assert "--train.halt-after: None -> 3" in msg
    harmless = changed(CONFIG, train={"halt_after": 3}, ckpt={"allow_changes": True})
    assert {c["flag"] for c in check_config(tmp_path, harmless)} == {"--train.halt-after", "--ckpt.allow-changes"}
    allowed = changed(now, ckpt={"allow_changes": True})
    assert len(check_config(tmp_path, allowed)) == 5
    assert check_config(tmp_path / "nowhere", now) == []  # no saved config: nothing to compare


def test_a_flag_added_since_the_run_started_is_harmless_at_its_default(tmp_path):
    """A run saved before the code gained `--ref.ranks` resumes with it at its default (None: the old behaviour),
    but not with it set."""
    from algos.grpo import Args
    from core.logger import config_dict

    saved = config_dict(Args())
    del saved["ref"]["ranks"], saved["ref"]["strategy"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    changes = check_config(tmp_path, Args())
    assert {c["flag"] for c in changes} == {"--ref.ranks", "--ref.strategy"} and all(c["harmless"] for c in changes)
    args = Args()
    args.ref.ranks = 2
    with pytest.raises(ValueError, match=r"--ref.ranks: <absent> -> 2"):
        check_config(tmp_path, args)


def test_a_run_saved_under_a_renamed_flag_resumes(tmp_path):
    """sft.py's `--train.max-tokens-per-micro-batch` became `--train.max-tokens-per-micro` (the RL scripts' name): a
    run whose config.json holds the old key resumes at the same value, and is refused at another one."""
    from algos.sft import Args
    from core.logger import config_dict

    saved = config_dict(Args())
    saved["train"]["max_tokens_per_micro_batch"] = saved["train"].pop("max_tokens_per_micro")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert all(c["harmless"] for c in check_config(tmp_path, Args()))
    args = Args()
    args.train.max_tokens_per_micro = 8192
    with pytest.raises(ValueError, match=r"--train.max-tokens-per-micro: 4096 -> 8192"):
        check_config(tmp_path, args)


# ------------------------------------------------------------------------------------- one writer per run folder
HOLDER = """
import sys
from core.config import LoggerConfig
from core.logger import RunLogger
logger = RunLogger(LoggerConfig(quiet=True, tensorboard=False), sys.argv[1], {"train": {"lr": 0.001}}, 10)
logger.log({"loss/x": 1.0}, 1)
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin: then the run ends as a finished run does
logger.close()
"""


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process running in `run_dir` (a RunLogger that logged step 1), until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "holding"
    return proc


def files(run_dir: Path) -> dict:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_second_run_on_a_folder_in_use_is_refused_until_the_first_ends(tmp_path, capsys):
    """Two runs on one --run-dir: the second neither moves the first's files into previous_* (a new run) nor cuts
    its metrics (a resume); it stops naming the folder and the holder. Once the first has ended, the same command
    resumes."""
    cfg = LoggerConfig(quiet=True, tensorboard=False)
    first = hold(tmp_path)
    try:
        before = files(tmp_path)
        for resume_step in (0, 1):
            with pytest.raises(RunDirLocked) as err:
                RunLogger(cfg, tmp_path, CONFIG, 10, resume_step=resume_step)
            msg = str(err.value)
            assert msg.startswith(f"{tmp_path} is in use by another run (host {socket.gethostname()}, pid {first.pid}")
        assert files(tmp_path) == before and not list(tmp_path.glob("previous_*"))
    finally:
        first.communicate(timeout=60)  # stdin closed: the first run ends and releases the folder
    assert first.returncode == 0 and not (tmp_path / ".lock").exists()
    resumed = RunLogger(cfg, tmp_path, CONFIG, 10, resume_step=1)
    resumed.log({"loss/x": 2.0}, 2)
    resumed.close()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2] and not (tmp_path / ".lock").exists()
    assert "taken over" not in capsys.readouterr().err


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, capsys):
    first = hold(tmp_path)
    first.kill()  # SIGKILL: no exit handler runs, the lock stays
    first.wait(timeout=60)
    lock = tmp_path / ".lock"
    assert json.loads(lock.read_text())["pid"] == first.pid
    resumed = RunLogger(LoggerConfig(quiet=True, tensorboard=False), tmp_path, CONFIG, 10, resume_step=1)
    err = capsys.readouterr().err
    assert f"{lock} was left by pid {first.pid} on {socket.gethostname()}" in err and "taken over" in err
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    resumed.log({"loss/x": 2.0}, 2)
    resumed.close()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2] and not lock.exists()


def test_a_lock_held_on_another_host_is_refused(tmp_path):
    """Whether a process of another host still runs cannot be checked here: refused, saying how to release it."""
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-that-is-not-this-one", "pid": 4242, "started": None}))
    with pytest.raises(RunDirLocked, match=r"host node-that-is-not-this-one, pid 4242\).*delete .*\.lock$"):
        lock_run_dir(tmp_path)
    assert lock_run_dir(tmp_path, enabled=False) is None  # ranks other than 0 do not lock


# ------------------------------------------------------------------------------------- sft.py, end to end
def sft_args(run_dir: Path, **train):
    from algos.sft import Args

    args = Args()
    args.model.name_or_path = "cleanrlhf/tiny"
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(run_dir)
    args.eval.generate, args.eval.max_samples, args.eval.every = False, 64, 2
    args.train.warmup_steps, args.train.batch_size = 0, 16
    for k, v in train.items():
        setattr(args.train, k, v)
    return args


def test_sft_resumed_from_an_older_checkpoint_logs_every_step_once(tmp_path, capsys):
    """Halted after 5 of 6 steps with checkpoints after steps 2, 4 and 5; the step-5 checkpoint is then damaged (as a
    kill mid-write of a file would leave it): the resume warns, falls back to step 4, and metrics.jsonl and
    TensorBoard end with each step once, the step-0 eval once."""
    from algos.sft import main

    args = sft_args(tmp_path / "run", max_steps=6, halt_after=5)
    args.ckpt.every, args.ckpt.keep_last = 2, 5
    args.logger.tensorboard = True
    assert main(args)["halted"]
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000001", "step_00000003", "step_00000004"]
    (bad,) = (ckpt / "step_00000004" / "model").glob("*model_states.pt")
    bad.write_bytes(bad.read_bytes()[:100])
    capsys.readouterr()

    args.train.halt_after = None
    summary = main(args)
    assert summary["steps"] == 6
    assert str(bad) in capsys.readouterr().err  # the warning names the damaged file
    logged = rows(tmp_path / "run")
    assert Counter(r["step"] for r in logged) == Counter(range(7)), [r["step"] for r in logged]
    assert [r["step"] for r in logged if "eval/loss" in r] == [0, 2, 4, 6]
    assert [r["step"] for r in logged if "loss/sft" in r] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tb_scalars(tmp_path / "run" / "tb", "eval/loss")] == [0, 2, 4, 6]
    assert [s for s, _ in tb_scalars(tmp_path / "run" / "tb", "loss/sft")] == [1, 2, 3, 4, 5, 6]
    assert checkpoint.latest(ckpt) == ckpt / "step_00000005"


def test_sft_resume_with_a_changed_lr_is_refused_unless_allowed(tmp_path):
    from algos.sft import main

    args = sft_args(tmp_path / "run", max_steps=3, halt_after=1)
    args.eval.every = 0
    assert main(args)["halted"]
    config_file = tmp_path / "run" / "config.json"
    original = config_file.read_text()

    lr = args.train.lr
    args.train.lr, args.train.halt_after = lr * 2, None
    with pytest.raises(ValueError, match=rf"--train.lr: {lr} -> {lr * 2}") as err:
        main(args)
    assert "--ckpt.allow-changes" in str(err.value)
    assert config_file.read_text() == original and not (tmp_path / "run" / "config_changes.jsonl").exists()
    assert [r["step"] for r in rows(tmp_path / "run")] == [1]  # --eval.every 0: no step-0 eval row

    args.ckpt.allow_changes = True
    assert main(args)["steps"] == 3
    assert config_file.read_text() == original  # the flags the run started with
    recorded = {r["flag"]: r for r in map(json.loads, (tmp_path / "run" / "config_changes.jsonl").open())}
    assert recorded["--train.lr"]["saved"] == lr and recorded["--train.lr"]["now"] == lr * 2
    assert recorded["--train.halt-after"]["harmless"] and not recorded["--train.lr"]["harmless"]
    assert {r["resume_step"] for r in recorded.values()} == {1} and all("time" in r for r in recorded.values())
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]


def test_sft_on_a_folder_in_use_is_refused_before_it_writes(tmp_path):
    from algos.sft import main

    run = tmp_path / "run"
    first = hold(run)
    try:
        before = files(run)
        with pytest.raises(RunDirLocked, match=rf"^{run} is in use by another run \(host .*, pid {first.pid}"):
            main(sft_args(run, max_steps=2))
        assert files(run) == before and not list(run.glob("previous_*"))
    finally:
        first.communicate(timeout=60)


def test_an_embedded_name_and_the_folder_it_resolves_to_are_no_change(tiny_path):
    """A one-process run saves `cleanrlhf/tiny`, the same run resumed with `--train.ranks 2` (launched through Ray,
    which resolves embedded names first) has the folder: the same model, so no change to refuse; a real change of
    model is still one."""
    saved = {"actor": {"model": {"name_or_path": "cleanrlhf/tiny"}}, "ref": {"name_or_path": None}}
    resumed = {"actor": {"model": {"name_or_path": str(tiny_path)}}, "ref": {"name_or_path": None}}
    assert config_changes(saved, resumed) == []
    other = {"actor": {"model": {"name_or_path": "/elsewhere/model"}}, "ref": {"name_or_path": None}}
    assert [c["flag"] for c in config_changes(saved, other)] == ["--actor.model.name-or-path"]
