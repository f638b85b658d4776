"""Faults around a run folder: several runs taking over a killed run's lock at once (one of them gets it, every
trial), a lock file of non-UTF-8 bytes, a `--run-dir` that is a file, config.json / summary.json torn by a kill
(written by rename now; an old torn one is named when read), concurrent `python -m core.report` calls, and the
non-RL scripts run again on a finished run (refused, as the RL scripts do)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from core import checkpoint
from core.config import LoggerConfig
from core.logger import RunDirLocked, RunLogger, check_config, lock_run_dir, release_run_dir

ROOT = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    """The pid of a process of this host that has exited (a killed run's)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _slow_file_system() -> None:
    """Each rename and unlink returns after a random pause of up to 5 ms, as on a loaded machine or a network file
    system where another process runs between two steps of a takeover."""
    import random

    rng = random.Random(os.getpid())

    def slow(call):
        def wrapped(*a, **k):
            out = call(*a, **k)
            time.sleep(rng.random() * 0.005)
            return out

        return wrapped

    os.replace, os.rename, os.unlink = slow(os.replace), slow(os.rename), slow(os.unlink)


def _contender(folders: list[str], barrier, results) -> None:
    """One of several runs started at once on each folder: try the lock, wait until every contender has tried (a
    holder keeps it meanwhile, as a running run would), report, release."""
    _slow_file_system()
    for folder in folders:
        barrier.wait()
        try:
            lock_run_dir(folder)
            held = True
        except RunDirLocked:
            held = False
        barrier.wait()
        results.put((folder, os.getpid(), held))
        if held:
            release_run_dir(folder)
        barrier.wait()


def test_simultaneous_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
    """5 runs start at once on a folder whose lock a killed run left, 100 times: exactly one holds it each time (the
    others are refused, naming the holder), never two."""
    trials, contenders = 100, 5
    folders = []
    for i in range(trials):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        (folder / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "started": None}))
        folders.append(str(folder))
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(contenders), ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(folders, barrier, results)) for _ in range(contenders)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(trials * contenders)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    holders = {f: [pid for g, pid, held in got if g == f and held] for f in folders}
    assert all(len(h) == 1 for h in holders.values()), {f: h for f, h in holders.items() if len(h) != 1}


def test_a_lock_of_non_utf8_bytes_is_named(tmp_path):
    """A `.lock` holding bytes that are not text (a disk fault, a stray write): refused in one error naming the lock
    file and how to release it, not a UnicodeDecodeError."""
    lock = tmp_path / ".lock"
    lock.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(RunDirLocked, match=rf"locked by {lock}, which does not name its run .*delete {lock}$"):
        lock_run_dir(tmp_path)
    assert lock.read_bytes() == b"\xff\xfe\x00garbage\x80"


def test_a_run_dir_that_is_a_file_is_named(tmp_path):
    """`--run-dir` naming a file (or a path under one): one ValueError naming the flag, for the lock and the logger,
    and nothing written."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for run_dir, says in ((a_file, "is a file"), (a_file / "run", f"is inside {a_file}, which is a file")):
        with pytest.raises(ValueError, match=rf"^--run-dir {run_dir}: {says}, not a folder"):
            lock_run_dir(run_dir)
        with pytest.raises(ValueError, match=rf"^--run-dir {run_dir}: {says}"):
            RunLogger(LoggerConfig(quiet=True, tensorboard=False), run_dir, {"train": {}}, 10)
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rm", "grpo", "ppo"])
def test_every_script_names_a_run_dir_that_is_a_file_before_anything_loads(name, tmp_path):
    """The flag checks of every script (`check_args`) name it, before a model or a process group is set up."""
    import importlib

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    module = importlib.import_module(f"algos.{name}")
    args = module.Args()
    args.run_dir = str(a_file)
    with pytest.raises(ValueError, match=rf"^--run-dir {a_file}: is a file, not a folder"):
        from core.config import check_args

        check_args(args)


def test_the_script_command_names_a_run_dir_that_is_a_file_in_one_line(tmp_path):
    """As typed: the library-message routing (`quiet_libraries`, first thing in every script) cannot put its log
    under a file, so it leaves the console as it is and the script's check names the flag; no bare FileExistsError."""
    import sys

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "CLEANRLHF_VERBOSE"}
    out = subprocess.run([sys.executable, str(repo / "algos" / "sft.py"), "--run-dir", str(a_file)], cwd=repo,
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert out.returncode != 0
    assert f"ValueError: --run-dir {a_file}: is a file, not a folder" in out.stderr, out.stderr[-2000:]
    assert "FileExistsError" not in out.stderr and "NotADirectoryError" not in out.stderr, out.stderr[-2000:]
    assert a_file.read_text() == "mine"


def _reader(path: Path, stop: threading.Event, torn: list) -> None:
    while not stop.is_set():
        try:
            json.loads(path.read_bytes())
        except FileNotFoundError:
            pass
        except ValueError as e:
            torn.append(str(e))


def test_config_and_summary_are_never_seen_half_written(tmp_path):
    """A reader polling config.json and summary.json while the logger writes them (a large config; a summary
    rewritten many times) never sees a torn file: they are written by rename, as a kill mid-write would otherwise
    leave them."""
    big = {"data": {"path": ["x" * 200] * 20000}, "train": {}, "logger": {"quiet": True}}
    stop, torn = threading.Event(), []
    readers = [threading.Thread(target=_reader, args=(tmp_path / name, stop, torn)) for name in
               ("config.json", "summary.json")]  # fmt: skip
    for t in readers:
        t.start()
    try:
        for i in range(5):
            run = RunLogger(LoggerConfig(quiet=True, tensorboard=False), tmp_path, big, 10, resume_step=i)
            run.close({"steps": i, "notes": ["y" * 200] * 20000})
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not torn, torn[:3]
    assert json.loads((tmp_path / "config.json").read_text()) == big
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_config_or_summary_is_named_at_resume(tmp_path):
    """A config.json or summary.json torn by a kill (runs before they were written by rename): the resume stops on
    one ValueError naming the file and what to do, not a bare JSONDecodeError."""
    (tmp_path / "config.json").write_text('{"train": {"lr": 0.00')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: unreadable, not JSON .*delete it to resume"):
        check_config(tmp_path, {"train": {"lr": 1e-3}, "ckpt": {"allow_changes": False}})
    (tmp_path / "summary.json").write_bytes(b'{"steps": 2, "hal')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'summary.json'}: unreadable, not JSON .*finished"):
        checkpoint.refuse_finished(tmp_path, tmp_path / "checkpoints", 2)


def _report_writer(run_dir: str, barrier, results) -> None:
    from core import report

    for _ in range(3):
        barrier.wait()
        try:
            report.write_report(run_dir)
            results.put("ok")
        except Exception as e:  # noqa: BLE001
            results.put(f"{type(e).__name__}: {e}")


def test_concurrent_reports_each_write_a_whole_page(tmp_path):
    """4 `python -m core.report` calls at once on one run folder (or the run's end beside one), 3 times: each
    writes its page whole and moves it into place (before, they shared one temporary name: one moved another's
    half-written page, then failed to find its own)."""
    from core import report  # imported once here: the writers fork with it loaded

    rows = [{"step": s, "rollout/reward_mean": s / 100, "loss/kl": 0.01} for s in range(1, 201)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [{"step": s, "kind": "train", "index": i, "prompt": "p" * 200, "response": "r" * 2000, "reward": 1.0}
               for s in range(1, 11) for i in range(64)]  # fmt: skip
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    page = report.write_report(tmp_path).read_text()
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_report_writer, args=(str(tmp_path), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in range(12)]
    for p in procs:
        p.join(timeout=60)
    assert got == ["ok"] * 12
    written = (tmp_path / "report.html").read_text()
    assert len(written) == len(page) and written.rstrip().endswith("</html>")
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ the non-RL scripts on a finished run
def test_resume_refuses_a_finished_run_whose_newest_checkpoint_is_older(tmp_path):
    """What every script's resume (`checkpoint.resume`: sft, dpo, kto, rm and the RL scripts) does with a run folder
    whose run finished all its steps after its newest checkpoint (`--train.halt-after` jobs with `--ckpt.every
    0`): refused, naming the finished run, before any engine is restored. A halted run, or one whose newest
    checkpoint is its last step, resumes."""
    from types import SimpleNamespace

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    (ckpt / "step_00000000").mkdir(parents=True)
    (ckpt / "step_00000000" / "rng_rank0.pt").write_bytes(b"x")
    checkpoint.write_manifest(ckpt / "step_00000000")
    args = SimpleNamespace(ckpt=SimpleNamespace(resume=True), train=SimpleNamespace(max_steps=2))
    untouchable = {"model": object()}  # restoring it would fail: the refusal comes first
    (run / "summary.json").write_text(json.dumps({"steps": 2, "export_dir": str(run / "hf")}))
    with pytest.raises(ValueError, match=rf"^{run} holds a finished run of 2 steps .*step_00000000.*another --run-dir"):
        checkpoint.resume(untouchable, ckpt, run, args)
    (run / "summary.json").write_text(json.dumps({"steps": 1, "halted": True}))
    with pytest.raises(AttributeError):  # a halted run resumes: it gets as far as restoring the engine
        checkpoint.resume(untouchable, ckpt, run, args)


@pytest.mark.slow
def test_sft_run_again_on_its_finished_run_is_refused(tmp_path):
    """sft.py, `--train.halt-after 1 --ckpt.every 0` over 2 steps: halted, then resumed to the end, then the same
    command once more: refused (it used to train the last step again and overwrite the finished run's model)."""
    from algos.sft import Args, main

    args = Args(run_dir=str(tmp_path / "run"))
    args.model.name_or_path = "cleanrlhf/tiny"
    args.logger.quiet, args.logger.tensorboard = True, False
    args.eval.generate, args.eval.max_samples, args.eval.every = False, 16, 0
    args.train.max_steps, args.train.halt_after, args.train.batch_size, args.train.warmup_steps = 2, 1, 8, 0
    args.ckpt.every = 0
    assert main(args)["halted"]
    args.train.halt_after = None
    assert main(args)["steps"] == 2
    model = (tmp_path / "run" / "hf" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"holds a finished run of 2 steps .*nothing to resume.*step_00000000"):
        main(args)
    assert (tmp_path / "run" / "hf" / "model.safetensors").read_bytes() == model
