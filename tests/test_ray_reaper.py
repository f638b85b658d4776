"""A SIGKILLed driver leaves nothing of its local Ray behind: before `core/reaper.py`, Ray's `DashboardAgent` and
`RuntimeEnvAgent` outlived the driver (they notice the raylet is gone, then hang reporting it to the dead GCS)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core import reaper

REPO = Path(__file__).resolve().parent.parent


def test_the_reaper_ends_a_killed_parents_descendants_and_nothing_else(tmp_path):
    """Without Ray: a parent with a child and a grandchild (in a session of its own, as Ray's agents outlive their
    parent) is SIGKILLed; the reaper ends both, and leaves a process that was never the parent's alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        reaper = subprocess.Popen([sys.executable, {str(REPO / "core" / "reaper.py")!r}, str(__import__("os").getpid())],
                                  start_new_session=True)
        child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                                  "start_new_session=True); time.sleep(60)"], start_new_session=True)
        print(reaper.pid, child.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        reaper_pid, child_pid = map(int, parent.stdout.readline().split())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(reaper.descendants(parent.pid, reaper.processes())) < 3:
            time.sleep(0.2)  # reaper, child, grandchild
        family = reaper.descendants(parent.pid, reaper.processes()) - {reaper_pid}
        assert child_pid in family and len(family) == 2, family
        time.sleep(2 * reaper.POLL_S)  # the reaper has seen them
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and family & set(reaper.processes()):
            time.sleep(0.2)
        assert not family & set(reaper.processes()), "the killed parent's descendants are still running"
        assert bystander.poll() is None  # never the parent's: left alone
    finally:
        bystander.kill()
        parent.kill()


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_ray_daemon(tmp_path):
    """`core.placement.init_ray` starts Ray on this machine (gcs_server, raylet, the agents), the driver is SIGKILLed:
    within 15 s none of the processes it had started is left."""
    code = textwrap.dedent("""
        import time
        from core.placement import RayConfig, init_ray
        init_ray(RayConfig(num_cpus=1))
        print("ready", flush=True)
        time.sleep(120)
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env, cwd=REPO)  # fmt: skip
    try:
        assert driver.stdout.readline().strip() == "ready"
        time.sleep(3)  # the raylet's agents are up
        procs = reaper.processes()
        family = reaper.descendants(driver.pid, procs)
        names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() for pid in family
                 if Path(f"/proc/{pid}/cmdline").exists()}  # fmt: skip
        assert any("raylet" in n for n in names.values()) and any("Agent" in n for n in names.values()), names
        time.sleep(2 * reaper.POLL_S)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and family & set(reaper.processes()):
            time.sleep(0.5)
        left = {names.get(pid, pid) for pid in family & set(reaper.processes())}
        assert not left, f"left running after the driver was killed: {left}"
    finally:
        driver.kill()
