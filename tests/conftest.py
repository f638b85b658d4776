"""Shared test setup: quiet tokenizers, AVX2 CPU math on every x86-64 machine, one torch thread in the tests and in
every process they start (CI is a shared 2-core machine), and the embedded tiny model.

The embedded artifacts are built in the user's normal cache ($CLEANRLHF_HOME, default ~/.cache/cleanrlhf), so CI
and repeated runs build them once (under a file lock: two workers may ask at once).

The full suite runs on two pytest-xdist workers, a test file per worker (`-n 2 --dist loadfile`, README command
(2)): a module's fixtures (an in-process vLLM engine, a model trained once) are built once, and while one worker waits
on Ray actors or a subprocess the other computes. Tests that listen on fixed addresses keep to their own: the SLURM
cluster on 127.0.0.2/.3 (tests/slurm_cluster.py), `ray_nodes` heads on free ports. (`--dist loadgroup` would have
let files share a worker, but under pytest 9.2 its groups have no effect: xdist 3.8 marks a test's group by rewriting `item._nodeid`, which pytest 9 no longer reads.)

The files whose tests take longest go first (`LONGEST_FIRST`, `pytest_collection_modifyitems`), and xdist's own order
(files with the most tests first) is turned off: a file of three tests can take six minutes, and one dealt out last
leaves the other worker idle at the end (the longest-first rule for dividing jobs among workers).
"""

import contextlib
import math
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from core.embedded import reproducible_cpu_env  # noqa: E402  (no torch inside: the pin must precede `import torch`)

# The learning tests assert thresholds measured on one machine; AVX-512 kernels round differently from AVX2 ones and,
# over hundreds of steps, move those numbers. Pinned, every x86-64 machine with AVX2 runs the suite's math alike
# (the processes the tests start inherit it: Ray actors, vLLM workers, the warm-start build).
for _key, _value in reproducible_cpu_env().items():
    os.environ.setdefault(_key, _value)

# torch.compile's on-disk cache (vLLM compiles a tensor-parallel engine's vocabulary mask, among others) is shared by
# every process of the user on this machine whatever its ATEN_CPU_CAPABILITY. With a cache written by processes
# without the pin (scripts run on this AVX-512 machine, a test engine run with AVX-512), every tensor-parallel vLLM
# engine of the suite failed its first step ("index out of range in self" in worker 1's embedding; 2026-12-06); the
# same tests passed with an empty cache and again with the suite's own cache warm. The suite keeps its own cache, one
# per pinned kernel set.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    "/tmp", f"torchinductor_{os.getuid()}_aten_{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}"))

# One OpenMP/MKL thread in every process a test starts (scripts run as users run them, SLURM jobs, graders, servers,
# builds), as in the test processes themselves: a child left at torch's default (a thread per core) competes with the
# other worker's test and both spin. On a 2-core Xeon with the other core busy, a 6-step `algos/grpo.py` took 89 s
# (57 s of training) with two threads and 52 s (21 s) with one (2026-11-28). Ray ranks and engines set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # OpenMP threads oversubscribe a busy 2-core machine badly; the models are tiny


# Test files by their time in the full suite on a 2-core Xeon, longest first (summed from `--durations=0` of a run of
# 2026-11-28; each takes 3-13 minutes on one worker): dealt out to the two workers before the rest.
LONGEST_FIRST = ("test_slurm.py", "test_opd.py", "test_model_groups.py", "test_crash_resume.py", "test_course.py",
                 "test_grpo.py", "test_faults_scale.py", "test_grpo_async.py", "test_tool_agent.py", "test_fork.py",
                 "test_real_size.py", "test_lora_rl.py", "test_qlora.py", "test_autotp.py", "test_commands.py", "test_frameworks.py", "test_env_adapters.py", "test_rl_scripts.py", "test_ppo.py", "test_noise.py",
                 "test_dpo.py", "test_sft.py", "test_reinforce_pp.py", "test_faults_training.py",
                 "test_course_sandbox.py", "test_server_faults.py")  # fmt: skip


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below, not "most tests first"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """`LONGEST_FIRST`'s files first, in its order; every other file after them in collection order (a stable sort:
    the tests of a file keep theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Unit roundoff of float32 (half the gap between 1 and the next float32).
F32_U = 2.0**-24


def f32_rtol(n_terms: int, updates: int = 0) -> float:
    """Relative tolerance for two float32 results that add the same `n_terms` numbers in different orders (one rank
    against two, packed rows against padded ones, a sequence split over an SP group against whole): a float32 sum of n
    terms computed in any order is within (n − 1)·u of the exact sum, relative to the sum of the terms' magnitudes
    (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §4.2), so two orders differ by at most
    2(n − 1)·u < 2n·u. After `updates` optimizer steps the weights themselves differ by that much and every later
    loss inherits the difference again, so the bound grows by one such term per update: 2n·u·(1 + updates). Tight
    constants such as 1e-5 only held where a CPU's kernels happened to round alike (an AMD EPYC rounded one DPO step
    1.3e-5 apart where a Xeon agreed to 1e-6)."""
    return 2 * n_terms * F32_U * (1 + updates)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module, restored after it: an earlier module (vLLM's CPU worker binds threads)
    may have changed the count, and two spinning OpenMP threads on a busy 2-core machine make every op slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_path():
    """Folder of the randomly initialised embedded model + tokenizer (`cleanrlhf/tiny`), built on first use."""
    from core import embedded

    return embedded.ensure_tiny_base()


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from core import models

    return models.load_tokenizer(str(tiny_path))


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    """The tiny causal LM in fp32, eval mode (no dropout), shared read-only by tests that do not train it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model, tokenizer or process-group setup fails the test: validation must come before all of it."""
    from core import engine, models

    def loaded(*_, **__):
        raise AssertionError("a model, tokenizer or process group was set up before the flags were checked")

    for module, name in [(engine, "init_distributed"), (models, "max_positions"), (models, "load_tokenizer"),
                         (models, "load_causal_lm"), (models, "load_scalar_model")]:  # fmt: skip
        monkeypatch.setattr(module, name, loaded, raising=False)


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict:
    """The environment for a child process: this one's without the torch.distributed variables that in-process
    tests set (a child would try to join this process's world, or bind its MASTER_PORT: EADDRINUSE), plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARS} | {"TOKENIZERS_PARALLELISM": "false"} | extra


def in_process_engines(path: str, dtype: str):
    """Body of a module fixture (`yield from`): one in-process vLLM engine over `path`, shut down afterwards."""
    from core import rollout

    cfg = rollout.VLLMConfig(in_process=True, dtype=dtype, kv_cache_gib=0.5, timeout_s=120)
    engines = rollout.create_engines(path, cfg, seed=0)
    yield engines
    engines.shutdown()


def short_rl_run(main, args, run_dir, steps: int = 12, eval_k: int = 1) -> tuple[dict, list[dict]]:
    """The learning check every RL script's slow test makes: `steps` steps of the script's defaults (64 prompts x 8
    samples; 12 x 32 was too noisy to test). Measured 2026-11-30 from the warm start's 0.48 greedy pass@1: 12 steps
    raised it by 0.29-0.31 for ppo, reinforce_pp, sapo and cispo (8 steps: 0.14-0.26) and by 0.20 for grpo and rloo,
    whose tests run 16 (0.27); the tests ask for 0.1, eval at the start and end (greedy pass@1, what the tests assert; `eval_k`
    > 1 adds the sampled pass@k, 4 x the eval's generations), and `--debug` so the engine's log-probs must equal the
    trainer's after every sync. Returns the summary and the metrics.jsonl rows."""
    import json

    args.train.max_steps, args.eval.every, args.eval.k = steps, steps, eval_k
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(run_dir)
    args.debug = True
    summary = main(args)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def ranks_2_vs_1(args_cls, main, tmp_path, configure=None, summaries: dict | None = None) -> dict[int, list[dict]]:
    """The multi-rank check every RL script with `--train.ranks` makes: 2 steps with `--train.ranks 2` (Ray placement
    group, two ZeRO-3 ranks in one gloo world, the vLLM engine as a colocated Ray actor, `--debug` checking engine ==
    trainer log-probs after every sync), then the same in one process. `configure(args, ranks)`, if given, changes
    the arguments further. Returns the metrics.jsonl rows with a `loss/` key of each, by rank count (and the runs'
    summaries in `summaries`, if given)."""
    import json

    import ray

    rows = {}
    for ranks in (2, 1):
        args = args_cls()
        args.train.ranks, args.train.max_steps, args.rollout.batch_size, args.eval.every = ranks, 2, 16, 0
        args.ds.zero_stage = 3
        args.debug = True
        args.ray.num_cpus = 4  # logical CPUs: two ranks and the engine share them, half a bundle each
        args.logger.quiet, args.logger.tensorboard = True, False
        args.run_dir = str(tmp_path / f"r{ranks}")
        if configure is not None:
            configure(args, ranks)
        try:
            summary = main(args)
            if summaries is not None:
                summaries[ranks] = summary
        finally:
            if ranks == 2:
                ray.shutdown()
        rows[ranks] = [json.loads(line) for line in open(tmp_path / f"r{ranks}" / "metrics.jsonl") if "loss/" in line]
    assert_samples_agree(tmp_path / "r2", tmp_path / "r1")
    return rows


def assert_samples_agree(run_a, run_b) -> None:
    """The first step's kept samples (samples.jsonl) of two runs that sampled alike: the same samples, and what the
    loss saw of each token (gathered from the ranks that trained it) the same up to float32 reordering."""
    import json

    def first_step(run):
        rows = [json.loads(line) for line in open(run / "samples.jsonl")]
        return {r["index"]: r for r in rows if r["kind"] == "train" and r["step"] == 1}

    a, b = first_step(run_a), first_step(run_b)
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    for i, row in a.items():
        assert row["response"] == b[i]["response"] and row["reward"] == b[i]["reward"]
        if not row["kept"]:
            continue
        assert row["tokens"].keys() == b[i]["tokens"].keys(), i
        for key in ("trainer_logp", "ratio", "advantage", "kl", "value", "teacher_logp"):
            if key in row["tokens"]:
                got, want = (
                    [math.nan if x is None else x for x in r["tokens"][key]] for r in (row, b[i])
                )  # fmt: skip
                assert got == pytest.approx(want, rel=1e-4, abs=1e-4, nan_ok=True), (i, key)


def zero3_other_reference(args, ranks: int) -> None:
    """`ranks_2_vs_1`'s `configure` for the `--ref.*` check: the KL to the untrained base model (`cleanrlhf/tiny`), far
    from 0 from the first step on, with the reference partitioned over the 2 ranks (`--ref.zero-stage 3`) against a
    whole one in one process. A script whose KL is off by default gets coefficient 0.05."""
    args.algo.kl_coef = args.algo.kl_coef or 0.05
    args.ref.name_or_path = "cleanrlhf/tiny"
    args.ref.zero_stage = 3 if ranks == 2 else 0


def assert_first_step_agrees(rows: dict[int, list[dict]], extra_keys: tuple[str, ...] = ()) -> None:
    """What every 2-rank test asserts on `ranks_2_vs_1`'s rows (with `zero3_other_reference`): one row per step (only
    rank 0 logs), the same first-step samples, a KL far from 0, and the same losses, gradient norm, clip fraction and
    KL (plus `extra_keys`) as one process."""
    assert len(rows[2]) == 2  # one row per step: only rank 0 logs
    first2, first1 = rows[2][0], rows[1][0]
    assert first2["rollout/reward_mean"] == first1["rollout/reward_mean"]  # the same samples
    assert first1["loss/kl"] > 0.1
    for key in ("loss/policy", "train/grad_norm", "loss/clipfrac", "loss/kl", *extra_keys):  # 16 x 8 rows of <= 16 tokens
        assert first2[key] == pytest.approx(first1[key], rel=max(1e-4, f32_rtol(16 * 8 * 16)), abs=1e-6), key


_PROCESS_LOCAL_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")  # fmt: skip
_RAY_TEMP_DIRS: dict[str, str] = {}


@contextlib.contextmanager
def ray_nodes(ips: list[str], port: int, num_cpus: int, object_store_bytes: int, extra: tuple[str, ...] = ()):
    """A Ray cluster of one node per address in `ips` on this machine (`ray start --block`, the head on ips[0]), each
    started by `Popen` and stopped by its PID (never `ray stop`), in this process's Ray auth mode (set to disabled
    when unset); yields the head's address once every node has joined. `Popen` execs without copying this process's
    mappings, where `ray.init()`'s own start forks it."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from core.engine import free_port

    ray_cli, address = str(Path(sys.executable).with_name("ray")), f"{ips[0]}:{port}"
    # Not what earlier tests left in this process's environment (a process group's RANK and MASTER_PORT, an in-process
    # vLLM's settings): the nodes' workers would inherit it.
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_LOCAL_ENV and not k.startswith("VLLM_")}
    # The nodes authenticate as this process does (a driver here or a child it starts inherits the mode). Ray 2.60
    # switches a process to token auth for good ("RAY_AUTH_MODE=token" and its cached config) at its first local
    # `ray.init()` when the variable is unset; a cluster started with auth disabled then rejects this driver's
    # replies ("Missing authorization header") and cancels every actor it creates before it runs.
    env["RAY_AUTH_MODE"] = os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay under 107 characters
    _RAY_TEMP_DIRS[address] = temp
    common = ["--num-cpus", str(num_cpus), "--num-gpus", "0", "--disable-usage-stats", "--block", "--temp-dir", temp,
              "--object-store-memory", str(object_store_bytes), *extra]  # fmt: skip
    procs = []
    try:
        deadline = time.time() + 120
        for i, ip in enumerate(ips):
            # A head's other listening ports are its own too, not Ray's defaults (the client server's 10001, the
            # dashboard agent's 52365): a SLURM job's Ray head on this machine may hold those while the suite runs
            # on two workers (README command (2)); no dashboard.
            own = ["--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                   "--include-dashboard", "false"]  # fmt: skip
            where = ["--head", "--port", str(port), *own] if i == 0 else ["--address", address]
            procs.append(subprocess.Popen([ray_cli, "start", *where, "--node-ip-address", ip, *common], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            while True:
                out = subprocess.run([ray_cli, "status", "--address", address], env=env, capture_output=True,
                                     text=True)  # fmt: skip
                if out.returncode == 0 and out.stdout.count(" node_") >= i + 1:
                    break
                assert time.time() < deadline and procs[-1].poll() is None, f"the Ray node on {ip} did not start"
                time.sleep(1)
        yield address
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
        _RAY_TEMP_DIRS.pop(address, None)


def ray_log_tail(address: str, lines: int = 25) -> str:
    """The last lines of the GCS, raylet and driver logs of the `ray_nodes` cluster at `address`: what a failed
    assertion about that cluster prints."""
    from pathlib import Path

    logs = Path(_RAY_TEMP_DIRS.get(address, "/nonexistent"), "session_latest", "logs")
    out = []
    for pattern in ("gcs_server.out", "raylet.out", "python-core-driver-*.log"):
        for path in sorted(logs.glob(pattern)):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out) or f"no Ray logs under {logs}"
