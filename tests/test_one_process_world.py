"""A plain `python algos/x.py` run makes a torch.distributed world of one (`core.engine.init_distributed`): its store
listens on 127.0.0.1 only (MASTER_ADDR), never on every interface, and the world still works after being torn down
and made again in the same process on the same port while the last one's store is still held (an in-process vLLM
engine destroys the world at shutdown; the next run in the process makes a new one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

PROBE = """
import json, os, psutil, torch
import torch.distributed as dist
from core.engine import init_distributed
seen, held = [], []
for _ in range(2):
    init_distributed("gloo", 60)
    t = torch.ones(2)
    dist.all_reduce(t)
    listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    seen.append({"listening": listening, "port": int(os.environ["MASTER_PORT"]), "sum": t.tolist()})
    held.append(dist.new_group([0], backend="gloo"))  # a group kept past the world (vLLM, DeepSpeed)
    dist.destroy_process_group()
print("RESULT " + json.dumps(seen))
"""


def test_one_process_world_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for world in seen:
        assert world["sum"] == [1.0, 1.0]
        assert ["127.0.0.1", world["port"]] in world["listening"], world  # the store, on MASTER_ADDR
        wildcard = [(ip, port) for ip, port in world["listening"] if ip in ("0.0.0.0", "::", "")]
        assert not wildcard, f"listening on every interface: {wildcard}"
