"""Ends what a killed driver leaves running: `python core/reaper.py PID` watches process PID and, once it is gone,
terminates every process that was its descendant while it lived (SIGTERM, then SIGKILL after a grace period).

Why: Ray's daemons share the fate of the driver that started them through the kernel (PR_SET_PDEATHSIG) or their
parent, except its agents: after a SIGKILL of the driver, `ray::DashboardAgent` and `ray::RuntimeEnvAgent` (ray
2.60) notice the raylet is gone and then hang reporting it to the dead GCS, forever. `core.placement.init_ray`
starts one reaper per driver that starts a local Ray instance.

Standalone on purpose (no imports from core or any library): it must start in milliseconds and outlive the driver.
Linux only (/proc); elsewhere it exits at once. It never touches a process that was not the driver's descendant:
each is known by its pid and its start time, so a reused pid is left alone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 1.0
GRACE_S = 3.0


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process now, from /proc/<pid>/stat."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... starttime is the 20th
        if fields[0] == "Z":  # a zombie has exited already
            continue
        out[int(name)] = (int(fields[1]), int(fields[19]))
    return out


def descendants(root: int, procs: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(known: dict[int, int]) -> dict[int, int]:
    now = processes()
    return {pid: start for pid, start in known.items() if pid in now and now[pid][1] == start}


def watch(driver: int) -> None:
    me = os.getpid()
    procs = processes()
    if driver not in procs:
        return
    driver_start = procs[driver][1]
    known: dict[int, int] = {}
    while driver in procs and procs[driver][1] == driver_start:
        known.update({pid: procs[pid][1] for pid in descendants(driver, procs) if pid != me})
        time.sleep(POLL_S)
        procs = processes()
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        left = alive(known)
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = alive(left)
        if not left:
            return


if __name__ == "__main__":
    if sys.platform.startswith("linux") and len(sys.argv) == 2:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the driver's terminal is the driver's to handle
        watch(int(sys.argv[1]))
