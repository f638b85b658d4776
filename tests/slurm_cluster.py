"""A real SLURM cluster of two nodes on this one machine, for the multi-node tests (tests/test_slurm.py).

munged, slurmctld and two slurmd daemons (nodes n1 and n2 on 127.0.0.2 and 127.0.0.3, SLURM's "multiple slurmd"
mode), with every state, spool, log and socket file in one temporary folder. The Debian packages (`slurm-wlm`,
`munge`) are installed when missing (as root, with apt). Started in about a second; stopped by the PIDs this module
started (never by name, so nothing else on the machine is touched).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

NODES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}
CPUS_PER_NODE = 4  # declared, more than the host has (SlurmdParameters=config_overrides): jobs only need slots
PORTS = {"ctld": 6817, "n1": 6818, "n2": 6819}  # below Ray's worker port range


def install() -> None:
    """apt-get install slurm-wlm and munge when their daemons are missing (Debian/Ubuntu, root)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("the SLURM tests need slurm-wlm and munge: run as root on Debian/Ubuntu (apt-get), or "
                           "install them first")  # fmt: skip
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


class SlurmCluster:
    """`with SlurmCluster(folder) as c:` a running two-node cluster; `c.env` is the environment for sbatch, squeue,
    scontrol (SLURM_CONF set); `c.run(...)` runs a SLURM command; `c.wait(job_id)` waits for a job to end."""

    def __init__(self, folder: Path):
        self.dir = Path(folder)
        self.procs: list[subprocess.Popen] = []
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SlurmCluster:
        install()
        self._start_munge()
        self._write_conf()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        for node in NODES:
            self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd.{node}")
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
            if sorted(line.split()[1] for line in out.splitlines() if line.strip()) == ["idle", "idle"]:
                return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the SLURM nodes did not become idle in 60 s; logs in {self.dir / 'log'}")

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.dir / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        self.procs.append(proc)
        return proc

    def _start_munge(self) -> None:
        d = self.dir / "munge"
        d.mkdir(parents=True, exist_ok=True)
        (self.dir / "log").mkdir(exist_ok=True)
        d.chmod(0o755)  # the socket's folder must be readable by clients ("Socket is inaccessible" at 700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        cmd = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.socket}",
               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"]  # fmt: skip
        self._spawn(cmd, "munged")
        deadline = time.time() + 20
        while not self.socket.exists():
            if time.time() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start; see {d / 'munged.log'}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "run", "spool/n1", "spool/n2"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "plugstack.conf").write_text("")
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr={addr} Port={PORTS[n]} "
                          f"CPUs={CPUS_PER_NODE} RealMemory=8000 State=UNKNOWN" for n, addr in NODES.items())  # fmt: skip
        self.conf.write_text(f"""ClusterName=cleanrlhf-test
SlurmctldHost=localhost
SlurmctldPort={PORTS["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MailProg=/bin/true
PlugStackConfig={d}/plugstack.conf
KillWait=5
MinJobAge=300
SlurmdParameters=config_overrides
{nodes}
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")

    # ------------------------------------------------------------------------------------------------ commands
    def lose_node(self, node: str) -> int:
        """The machine `node` vanishes: its slurmd, its job steps' slurmstepd and every process they started (a Ray
        node started by srun and its workers: all carry SLURMD_NODENAME=node) are SIGKILLed at once. Returns how
        many processes were killed."""
        import psutil

        slurmd = next(p for p in self.procs if p.args[-1] == node and p.args[0] == "slurmd")
        victims = {slurmd.pid: psutil.Process(slurmd.pid)}
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("SLURMD_NODENAME") == node:
                    victims[proc.pid] = proc
                    parent = proc.parent()
                    if parent is not None and parent.name().startswith("slurmstepd"):
                        victims[parent.pid] = parent
            except psutil.Error:
                continue
        for proc in victims.values():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        slurmd.wait()
        return len(victims)

    def restore_node(self, node: str, timeout_s: float = 120) -> None:
        """Start `node`'s slurmd again and wait until the node is idle (a node that SLURM set DOWN is resumed)."""
        self.procs = [p for p in self.procs if not (p.args[0] == "slurmd" and p.args[-1] == node)]
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd.{node}.restarted")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state = self.run(["sinfo", "-h", "-n", node, "-o", "%t"], check=False).stdout.strip()
            if state == "idle":
                return
            if state.startswith("down") or state.startswith("drain"):
                self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
            time.sleep(1)
        raise RuntimeError(f"node {node} not idle {timeout_s} s after its slurmd restarted")

    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: list[str], cwd: Path, env: dict | None = None) -> int:
        """Submit (`sbatch --parsable ARGS`) from `cwd`; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})}).stdout
        return int(out.strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...), from `scontrol show job`."""
        out = self.run(["scontrol", "show", "job", str(job)], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job: int, timeout_s: float, until: tuple = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                               "NODE_FAIL", "OUT_OF_MEMORY")) -> str:  # fmt: skip
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state = self.state(job)
            if state in until:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout_s} s")
