"""The course checker grades each file in a process of its own, with a time limit: a student's file that loops,
exits, crashes or changes the checker fails with a message saying so, and neither the grader nor the other students'
files are affected (docs/course/check.py, "Running the cases")."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env

REPO = Path(__file__).resolve().parents[1]
COURSE = REPO / "docs" / "course"
sys.path.insert(0, str(COURSE))

import check  # noqa: E402
from lessons import LESSONS  # noqa: E402

# A right answer to lesson 2 that imports only torch (a file graded in a second or two)
GOOD = """import torch


def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-9):
    r = rewards.view(-1, group_size)
    a = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        a = a / (r.std(dim=1, keepdim=True) + eps)
    return a.flatten()
"""
LOOPS_AT_IMPORT = GOOD + "\nwhile True:\n    pass\n"
LOOPS_IN_CASE_2 = GOOD.replace("    if scale_by_std:", "    while not scale_by_std:\n        pass\n    if scale_by_std:")
EXITS_AT_IMPORT = "import sys\n\nsys.exit(0)\n" + GOOD
OS_EXIT_IN_CASE_2 = GOOD.replace("    if scale_by_std:", "    if not scale_by_std:\n        import os\n        os._exit(0)\n"
                                 "    if scale_by_std:")  # fmt: skip
TAMPERS = "import __main__\n\n__main__.expect = lambda *a, **k: None\n\n\ndef group_advantages(*a, **k):\n    return 0\n"
WRONG = GOOD.replace("r.std(dim=1, keepdim=True)", "r.var(dim=1, keepdim=True)")


def _check(*args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(COURSE / "check.py"), *args], capture_output=True, text=True,
                         timeout=timeout, env=child_env())  # fmt: skip
    return out, time.monotonic() - start


def _one(tmp_path: Path, text: str, limit: str = "2") -> subprocess.CompletedProcess:
    mine = tmp_path / "02_mine.py"
    mine.write_text(text)
    out, _ = _check("2", str(mine), "--no-run", "--time-limit", limit)
    return out


def test_a_right_file_still_passes_through_its_own_process(tmp_path):
    out = _one(tmp_path, GOOD)
    assert out.returncode == 0 and out.stdout.count("ok  ") == 3, out.stdout + out.stderr


def test_a_file_that_loops_at_import_fails_within_the_time_limit(tmp_path):
    out = _one(tmp_path, LOOPS_AT_IMPORT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "did not finish within the lesson's time limit (2 s" in out.stdout and "while it was imported" in out.stdout


def test_a_function_that_loops_fails_that_case_and_the_cases_before_it_keep_their_verdict(tmp_path):
    out = _one(tmp_path, LOOPS_IN_CASE_2)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("  ok   one correct answer"), out.stdout
    assert lines[2].startswith("  FAIL Dr.GRPO") and "your function did not finish within" in lines[3], out.stdout
    assert lines[4].startswith("  FAIL a group") and "not run" in lines[5], out.stdout


def test_sys_exit_at_import_fails_the_file_saying_so(tmp_path):
    out = _one(tmp_path, EXITS_AT_IMPORT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ends the grading process while it is imported (SystemExit: 0" in out.stdout, out.stdout


def test_os_exit_in_the_function_fails_that_case_saying_so(tmp_path):
    out = _one(tmp_path, OS_EXIT_IN_CASE_2)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "  ok   one correct answer" in out.stdout, out.stdout
    assert "your function ends the grading process (exit status 0)" in out.stdout, out.stdout


def test_a_file_that_changes_the_checkers_expect_fails_saying_so(tmp_path):
    out = _one(tmp_path, TAMPERS)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "changed the checker's `expect`" in out.stdout, out.stdout


def test_a_class_with_a_looping_an_exiting_and_a_tampering_student_gets_its_whole_table(tmp_path):
    """The tamperer is graded first: the students after it are graded by an unchanged checker (a wrong file fails)."""
    files = {"a_tampers": TAMPERS, "b_good": GOOD, "c_loops": LOOPS_AT_IMPORT, "d_exits": EXITS_AT_IMPORT,
             "e_os_exit": OS_EXIT_IN_CASE_2, "f_wrong": WRONG, "g_good": GOOD}  # fmt: skip
    for student, text in files.items():
        (tmp_path / student).mkdir()
        (tmp_path / student / "02_group_advantage.py").write_text(text)
    out, took = _check("--class", str(tmp_path), "--no-run", "--time-limit", "2", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["student"]: r["lesson 2"] for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert rows == {
        "a_tampers": "fail: the file (changed the checker)",
        "b_good": "pass (cases)",
        "c_loops": "fail: the file (time limit)",
        "d_exits": "fail: the file (exits)",
        "e_os_exit": "fail: Dr.GRPO: scale_by_std=False (exits)",
        "f_wrong": "fail: one correct answer in a group of 4",
        "g_good": "pass (cases)",
    }, rows
    assert all(name in out.stdout for name in files), out.stdout


def test_a_files_code_runs_in_another_process_under_resource_limits(tmp_path):
    """`os.system(...)` at import runs, but in the grading process: not the grader's, and limited in CPU time,
    memory and file size."""
    mine = tmp_path / "02_mine.py"
    marker = tmp_path / "marker.txt"
    mine.write_text(f"import os, resource\nos.system('echo $PPID > {marker}')\n"
                    f"open({str(marker)!r}, 'a').write(repr([os.getpid(), resource.getrlimit(resource.RLIMIT_CPU),"
                    " resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_FSIZE)]))\n" + GOOD)  # fmt: skip
    assert [why for _, why in check.run_cases(LESSONS[2], mine, limit_s=5)] == [None, None, None]
    shell_parent, rest = marker.read_text().split("\n", 1)
    pid, cpu, memory, size = eval(rest)
    assert int(shell_parent) == pid != os.getpid()
    assert 0 < cpu[0] < 120 and memory[0] == check.MEMORY_LIMIT and size[0] == check.FILE_SIZE_LIMIT


def test_a_file_that_allocates_past_the_memory_limit_fails_with_a_memory_error(tmp_path):
    mine = tmp_path / "02_mine.py"
    mine.write_text(f"big = bytearray({check.MEMORY_LIMIT + (1 << 30)})\n" + GOOD)
    [(name, why)] = check.run_cases(LESSONS[2], mine, limit_s=10)
    assert name == "the file" and "does not import: MemoryError" in why, why


def test_what_a_function_returns_is_read_in_the_grading_process_and_compared_as_data(tmp_path):
    """An object the function returns is turned into data where the student's code runs; its methods never run in
    the grader (a `__repr__`, `__eq__` or `__reduce__` of the student's could run anything there)."""
    mine = tmp_path / "02_mine.py"
    marker = tmp_path / "pids"
    mine.write_text(f"""import os


class Sneaky:
    def __repr__(self):
        open({str(marker)!r}, "a").write(f"{{os.getpid()}}\\n")
        return "Sneaky()"

    def __eq__(self, other):
        open({str(marker)!r}, "a").write(f"{{os.getpid()}}\\n")
        return True

    def __reduce__(self):
        open({str(marker)!r}, "a").write(f"{{os.getpid()}}\\n")
        return (Sneaky, ())


def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-9):
    return Sneaky()
""")
    results = check.run_cases(LESSONS[2], mine, limit_s=5)
    assert all(why and "expected a tensor like" in why and "got Sneaky: Sneaky()" in why for _, why in results), results
    assert str(os.getpid()) not in marker.read_text().split()


def test_a_learning_run_that_does_not_end_is_stopped(tmp_path):
    log = tmp_path / "run.log"
    start = time.monotonic()
    assert not check._run([sys.executable, "-c", "import time; time.sleep(600)"], log, limit_s=1)
    assert time.monotonic() - start < 60 and "did not finish within 1 s" in log.read_text()


@pytest.mark.parametrize("number", [n for n, lesson in LESSONS.items() if lesson.function])
def test_a_lesson_page_states_the_time_limit_of_its_cases(number):
    page = LESSONS[number].page.read_text()
    exercise = page.split("## The exercise", 1)[1].split("\n## ", 1)[0]
    assert f"{check.TIME_LIMIT_S[number]} s" in exercise and "process of its own" in exercise, exercise


def starts_background_processes(pids: Path) -> str:
    """Code that starts three processes that outlive it, writing their pids to `pids`: one in its process group, one
    in a session of its own (`start_new_session`) and a daemon (a double fork into a new session, its parent gone at
    once, so that the kernel gives it to another parent). Each runs `sleep(600)` with `pids` on its command line."""
    return f"""import os, subprocess, sys

cmd = [sys.executable, "-c", "import time; time.sleep(600)", {str(pids)!r}]
with open({str(pids)!r}, "a") as out:
    for new_session in (False, True):
        out.write(f"{{subprocess.Popen(cmd, start_new_session=new_session).pid}}\\n")
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.execv(cmd[0], cmd)
        os.write(w, f"{{pid}}\\n".encode())
        os._exit(0)
    out.write(os.read(r, 64).decode())
"""


def running(pids: Path, wait_s: float = 0.0) -> list[int]:
    """The pids in `pids` whose process still runs the command written there (not a zombie, not a reused pid), after
    waiting up to `wait_s` for them to end (a SIGKILL takes effect a moment after it is sent)."""
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for pid in map(int, pids.read_text().split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(pids).encode() in cmdline and state != "Z":
                out.append(pid)
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_what_a_students_code_starts_in_the_background_is_gone_after_grading(tmp_path):
    """A process the student's file starts at import and leaves running (in its group, in a session of its own, or a
    daemon) ran on after grading: the group kill missed the two that left the group. After the cases (and after a
    learning run that does the same) none is left, and the file is graded as usual."""
    mine, pids, run_pids = tmp_path / "02_mine.py", tmp_path / "pids", tmp_path / "run_pids"
    mine.write_text(starts_background_processes(pids) + GOOD)
    try:
        assert [why for _, why in check.run_cases(LESSONS[2], mine, limit_s=10)] == [None, None, None]
        assert len(pids.read_text().split()) == 3  # the file did start all three
        assert running(pids, wait_s=1) == []
        assert check._run([sys.executable, "-c", starts_background_processes(run_pids)], tmp_path / "run.log", 30)
        assert len(run_pids.read_text().split()) == 3 and running(run_pids, wait_s=1) == []
    finally:
        for pid in running(pids) + (running(run_pids) if run_pids.exists() else []):
            os.kill(pid, 9)
