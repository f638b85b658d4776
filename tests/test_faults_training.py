"""Non-finite guards and halting: a NaN/inf loss or gradient stops every script before the optimizer step (naming the
step and the engine) and never reaches a checkpoint or an HF export; `--train.halt-after` always checkpoints, so the
next invocation resumes instead of starting over."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env as clean_env

from core import checkpoint, models
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig
from core.weights import gathered_state_dict

REPO = Path(__file__).resolve().parent.parent
IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25], [1, 40, 41, 42, 43, 44, 45]])


def tiny_engine(tiny_path, stage: int, lr: float = 1e-2):
    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    model = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path)))
    return ds_engine.make_engine(model, DSConfig(zero_stage=stage), lr)


def weights(engine) -> dict[str, torch.Tensor]:
    return gathered_state_dict(engine)


def poison_first_grad(param: torch.nn.Parameter, value: float):
    """Hook that puts `value` into one element of `param`'s gradient on the next backward only."""
    fired = []

    def hook(g):
        if fired:
            return g
        fired.append(1)
        g = g.clone()
        g.view(-1)[0] = value
        return g

    return param.register_hook(hook)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_norm_before_the_step_equals_deepspeeds(tiny_path, stage):
    """The norm read from where each ZeRO stage keeps the gradients (before `engine.step()`) is the one DeepSpeed
    computes inside the step: no shard of the gradient is missed."""
    engine = tiny_engine(tiny_path, stage)
    for j, rows in enumerate(([0], [1])):  # two micro-batches, one optimizer step
        engine.set_gradient_accumulation_boundary(j == 1)
        engine.backward(engine(input_ids=IDS[rows], labels=IDS[rows]).loss * 10)
    norm = ds_engine.grad_norm(engine)
    assert norm > 1 and ds_engine.optimizer_step(engine, 0, "model") == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_optimizer_step_refuses_a_non_finite_gradient(tiny_path, stage, value):
    """A finite loss whose gradient has one NaN/inf element in the first of two micro-batches: optimizer_step raises
    naming the engine and the step, and the weights stay exactly as they were (the step was never taken)."""
    engine = tiny_engine(tiny_path, stage)
    before = weights(engine)
    param = dict(engine.module.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    handle = poison_first_grad(param, value)
    for j, rows in enumerate(([0], [1])):
        loss = engine(input_ids=IDS[rows], labels=IDS[rows]).loss
        ds_engine.check_finite(loss, 7, "loss")  # the loss itself is finite
        engine.set_gradient_accumulation_boundary(j == 1)
        engine.backward(loss)
    handle.remove()
    assert not math.isfinite(ds_engine.grad_norm(engine))
    with pytest.raises(FloatingPointError, match=r"critic at step 7"):
        ds_engine.optimizer_step(engine, 7, "critic")
    after = weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_check_finite_names_the_step_and_the_loss():
    ds_engine.check_finite(torch.tensor(1.5), 3)
    with pytest.raises(FloatingPointError, match=r"non-finite value loss \(nan\) at step 3"):
        ds_engine.check_finite(torch.tensor(float("nan")), 3, "value loss")
    with pytest.raises(FloatingPointError, match="at step 4"):
        ds_engine.check_finite(torch.tensor([1.0, float("-inf")]), 4)


@pytest.mark.parametrize("stage", [0, 3])
def test_export_and_checkpoint_refuse_non_finite_weights(tiny_path, tokenizer, tmp_path, stage):
    engine = tiny_engine(tiny_path, stage)
    ds_engine.check_weights_finite(engine, 0)
    ds_engine.export_hf(engine, tokenizer, tmp_path / "good")
    assert (tmp_path / "good" / "model.safetensors").exists()
    param = dict(engine.module.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        (param.ds_tensor if stage == 3 else param).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match="actor after step 5"):
        ds_engine.check_weights_finite(engine, 5, "actor")
    with pytest.raises(FloatingPointError, match=f"{tmp_path / 'hf'}: not exported, non-finite weights in .*up_proj"):
        ds_engine.export_hf(engine, tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


# ---------------------------------------------------------------------------------------------- script level


def small_args(module: str, tmp_path: Path, **train):
    """A few-step run of `algos/<module>.py` on the tiny model: small batches, no evals, quiet logger."""
    import importlib

    mod = importlib.import_module(f"algos.{module}")
    args = mod.Args()
    args.model.name_or_path = "cleanrlhf/tiny"
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    args.eval.every, args.eval.max_samples = 0, 16
    if hasattr(args.eval, "generate"):
        args.eval.generate = False
    args.train.warmup_steps, args.train.batch_size = 0, 8
    for k, v in train.items():
        setattr(args.train, k, v)
    return mod, args


def non_finite_tensors(obj, where: str = "") -> list[str]:
    """Paths of the floating-point tensors holding a NaN or inf anywhere inside `obj` (dicts, lists, tensors), but
    dpo.py's cache of reference log-probs, where NaN marks a pair no batch uses."""
    if isinstance(obj, torch.Tensor):
        return [where] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, dict):
        return [w for k, v in obj.items() if k != "train_ref" for w in non_finite_tensors(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [w for i, v in enumerate(obj) for w in non_finite_tensors(v, f"{where}[{i}]")]
    return []


def assert_good_checkpoints_up_to(run_dir: Path, failed_step: int) -> None:
    """Checkpoints of the steps before `failed_step` (the last of them `latest`), every tensor in them finite, and no
    HF export."""
    ckpt = run_dir / "checkpoints"
    steps = sorted(int(p.name.removeprefix("step_")) for p in ckpt.glob("step_*"))
    assert steps and steps[-1] == failed_step - 1, (steps, failed_step)
    assert checkpoint.latest(ckpt) == ckpt / f"step_{failed_step - 1:08d}"
    files = [f for f in ckpt.rglob("*.pt")]
    assert files
    for f in files:
        bad = non_finite_tensors(torch.load(f, map_location="cpu", weights_only=False))
        assert not bad, (f, bad[:5])
    assert not (run_dir / "hf").exists() and not (run_dir / "hf.tmp").exists()


def test_sft_exits_non_zero_on_a_diverged_loss_keeping_its_good_checkpoints(tmp_path):
    """lr 1e30: after the first Adam step the weights are ~1e30 and the next forward overflows. The process stops with
    a non-zero exit naming the step; the checkpoints written before it are all there and finite; no HF export."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "algos" / "sft.py"), "--model.name-or-path", "cleanrlhf/tiny",
           "--train.lr", "1e30", "--train.warmup-steps", "0", "--train.max-steps", "6", "--train.batch-size", "8",
           "--ckpt.every", "1", "--ckpt.keep-last", "2", "--eval.every", "0", "--eval.max-samples", "16",
           "--eval.no-generate", "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    match = re.search(r"FloatingPointError: non-finite loss \(\w+\) at step (\d+)", proc.stderr)
    assert match, proc.stderr[-3000:]
    failed = int(match.group(1))
    assert 1 <= failed < 6
    assert_good_checkpoints_up_to(run_dir, failed)


def test_sft_stops_on_a_non_finite_gradient_of_a_finite_loss(tmp_path, monkeypatch):
    """From the third step on the loss gains a term worth 0 whose gradient is NaN (d√u/du at u = 0, times 0): the loss
    check passes, the gradient check stops the run before that optimizer step."""
    import algos.sft as sft

    mod, args = small_args("sft", tmp_path, max_steps=5, lr=1e-3)
    args.ckpt.every, args.ckpt.keep_last = 1, 5
    calls = []
    plain = sft.sft_loss

    def poisoned(logp, mask, num_tokens):
        calls.append(1)
        loss = plain(logp, mask, num_tokens)
        return loss + (logp * 0).sum().sqrt() * 0 if len(calls) > 2 else loss  # one micro-batch per step

    monkeypatch.setattr(sft, "sft_loss", poisoned)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient of the model at step 2"):
        mod.main(args)
    assert_good_checkpoints_up_to(Path(args.run_dir), 2)
    assert sorted(p.name for p in (Path(args.run_dir) / "checkpoints").glob("step_*")) == ["step_00000000",
                                                                                           "step_00000001"]  # fmt: skip


def test_dpo_raises_on_a_diverged_loss_keeping_its_good_checkpoints(tmp_path):
    mod, args = small_args("dpo", tmp_path, max_steps=6, lr=1e30)
    args.ckpt.every = 1
    with pytest.raises(FloatingPointError, match=r"at step (\d+)") as err:
        mod.main(args)
    failed = int(re.search(r"at step (\d+)", str(err.value)).group(1))
    assert 1 <= failed < 6
    assert_good_checkpoints_up_to(Path(args.run_dir), failed)


@pytest.mark.parametrize("module", ["sft", "dpo", "kto", "rm"])
def test_halt_checkpoints_without_ckpt_every_and_the_same_command_resumes(module, tmp_path):
    """`--train.halt-after 1` with `--ckpt.every 0`: the halt writes a checkpoint, so the same command run again
    trains the next step instead of repeating the first (a chain of time-limited cluster jobs makes progress)."""
    mod, args = small_args(module, tmp_path, max_steps=4, halt_after=1)
    args.ckpt.every = 0
    ckpt = Path(args.run_dir) / "checkpoints"
    assert mod.main(args) == {"steps": 1, "halted": True, "run_dir": args.run_dir}
    assert checkpoint.latest(ckpt) == ckpt / "step_00000000"
    assert mod.main(args) == {"steps": 2, "halted": True, "run_dir": args.run_dir}  # resumed at the second step
    assert checkpoint.latest(ckpt) == ckpt / "step_00000001"
    rows = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if f"loss/{module}" in r] == [1, 2]
    assert not (Path(args.run_dir) / "hf").exists()


@pytest.mark.parametrize("poisoned", ["critic", "actor"])
def test_ppo_update_names_the_engine_whose_gradient_is_non_finite(tiny_path, tokenizer, poisoned):
    """PPO steps two engines: a NaN gradient in either stops the update before that engine's optimizer step, and the
    error says which engine and which step. The critic's step comes first on each minibatch: a NaN in the actor's
    gradient leaves the actor untouched."""
    from types import SimpleNamespace

    from agents.executor import Episode
    from algos.ppo import Args, update
    from core.rl import sequences

    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    actor = ds_engine.make_engine(models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path))), DSConfig(), 1e-2)
    critic = ds_engine.make_engine(models.TokenValues(models.load_scalar_model(str(tiny_path), "fp32")), DSConfig(),
                                   1e-2)  # fmt: skip
    prompts = [tokenizer.encode(p) for p in ("12+34=", "5+6=")]
    responses = [tokenizer.encode(a) for a in ("46", "11")]
    episodes = [Episode({}, p, r, [0.0] * len(r), [1] * len(r), False) for p, r in zip(prompts, responses)]
    seqs = sequences(episodes, tokenizer.pad_token_id, torch.device("cpu"))
    run = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    engine = critic if poisoned == "critic" else actor
    before = weights(engine)
    handle = poison_first_grad(next(p for p in engine.module.parameters() if p.requires_grad), float("nan"))
    try:
        with pytest.raises(FloatingPointError, match=f"non-finite gradient of the {poisoned} at step 3"):
            update(actor, critic, None, seqs, torch.tensor([1.0, 0.0]), Args(), run, step=3, kl_coef=0.0)
    finally:
        handle.remove()
    after = weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


TWO_RANKS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from core import engine as ds_engine, models
from core.config import DSConfig, ModelConfig
rank, world, _ = ds_engine.init_distributed("gloo")
out = open(f"{sys.argv[3]}/rank{rank}.txt", "w")  # one file per rank: their stdout interleaves
ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25], [1, 40, 41, 42, 43, 44, 45]])[rank : rank + 1]  # different per rank
for stage in (0, 2, 3):
    for poison in (False, True):
        torch.manual_seed(0)
        engine = ds_engine.make_engine(models.load_causal_lm(ModelConfig(name_or_path=sys.argv[2])),
                                       DSConfig(zero_stage=stage), 1e-2)
        if poison and rank == 1:  # one rank's gradient only; under ZeRO-2/3 the NaN lands in both ranks' shards
            p = dict(engine.module.named_parameters())["model.layers.0.mlp.up_proj.weight"]
            p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
        engine.backward(engine(input_ids=ids, labels=ids).loss * 10)
        norm = ds_engine.grad_norm(engine)
        try:
            ds_norm = ds_engine.optimizer_step(engine, 4, "actor")
            print(f"stage {stage} poison {poison} rank {rank} ok {norm:.6f} {ds_norm:.6f}", file=out, flush=True)
        except FloatingPointError as e:
            print(f"stage {stage} poison {poison} rank {rank} raised {e}", file=out, flush=True)
"""


@pytest.mark.slow
def test_two_ranks_agree_on_the_gradient_norm_and_both_stop(tiny_path, tmp_path):
    """Two gloo ranks with different data at ZeRO-0/2/3: `grad_norm` (shards summed, or ZeRO-0's all-reduced copy
    counted once) equals DeepSpeed's norm on both ranks; a NaN in one rank's gradient stops both."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(ds_engine.free_port()), str(script), str(REPO), str(tiny_path), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert len(lines) == 12, lines
    for _, stage, _, poison, _, rank, what, *rest in lines:
        if poison == "True":
            assert what == "raised" and "of the actor at step 4" in " ".join(rest), (stage, rank, rest)
        else:
            assert what == "ok" and float(rest[0]) == pytest.approx(float(rest[1]), rel=1e-5), (stage, rank, rest)
    norms = {stage: float(rest[0]) for _, stage, _, poison, _, rank, what, *rest in lines if poison == "False"}
    assert norms["0"] == pytest.approx(norms["2"], rel=1e-5) and norms["0"] == pytest.approx(norms["3"], rel=1e-5)


@pytest.mark.slow
def test_a_dead_torchrun_rank_ends_the_job_with_an_error_instead_of_a_hang(tmp_path):
    """`torchrun --nproc_per_node 2 algos/sft.py` with rank 1 killed (SIGKILL) once the run has logged a step: the
    surviving rank does not wait in its next collective for ever. The job exits non-zero within a minute naming the
    failed rank, and no rank process is left behind (torchrun's agent stops the survivor; `--ds.timeout-s` bounds any
    collective it is in)."""
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(ds_engine.free_port()), str(REPO / "algos" / "sft.py"), "--model.name-or-path", "cleanrlhf/tiny",
           "--train.max-steps", "100000", "--train.batch-size", "16", "--eval.every", "0", "--ds.timeout-s", "60",
           "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir)]  # fmt: skip
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env() | {"OMP_NUM_THREADS": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.time() + 300
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.5)
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "sft.py" in " ".join(p.cmdline())}  # fmt: skip
        assert set(ranks) == {0, 1}, ranks
        ranks[1].send_signal(signal.SIGKILL)
        killed = time.time()
        code = proc.wait(timeout=120)
        ended_in = time.time() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "torchrun.log").read_text()
    assert code != 0 and ended_in < 60, (code, ended_in, out[-3000:])
    assert "rank" in out and ("exitcode  : -9" in out or "Signal 9" in out or "SIGKILL" in out), out[-3000:]
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE, "the surviving rank was left running"


def test_the_world_is_released_before_the_interpreter_finalizes(tmp_path):
    """Left to interpreter finalization, gloo's worker threads can abort a rank with SIGABRT after its last line ran
    ("terminate called without an active exception": a finished two-rank job failed that way). `init_distributed`
    registers the release at exit: a handler that runs after it sees no world, and the process exits 0."""
    script = tmp_path / "world.py"
    script.write_text(
        "import atexit, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import torch.distributed as dist\n"
        "atexit.register(lambda: print('world at exit:', dist.is_initialized(), flush=True))  # runs last (LIFO)\n"
        "from core import engine\n"
        "engine.init_distributed('gloo')\n"
        "engine.init_distributed('gloo')  # joined twice: released once, no error\n"
        "print('world in main:', dist.is_initialized(), flush=True)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world in main: True" in proc.stdout and "world at exit: False" in proc.stdout, proc.stdout
    assert "destroy_process_group at exit" not in proc.stderr, proc.stderr[-2000:]


def test_a_stale_deepspeed_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    """A process killed while DeepSpeed JIT-builds its CPU shm op leaves torch's baton file; every later
    `init_distributed` would wait on it forever. An old one is removed with a message naming it; a fresh one (a build
    in progress) is left alone."""
    import time

    from core.engine import clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert clear_stale_build_lock() is None and lock.exists()  # a build may be running
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_build_lock() == lock and not lock.exists()
    assert str(lock) in capsys.readouterr().err
    # a few minutes old: kept while a compiler runs, removed when none does (its builder is gone)
    from core import engine

    lock.touch()
    old = time.time() - 300
    os.utime(lock, (old, old))
    monkeypatch.setattr(engine, "_compiling", lambda: True)
    assert clear_stale_build_lock() is None and lock.exists()
    monkeypatch.setattr(engine, "_compiling", lambda: False)
    assert clear_stale_build_lock() == lock and not lock.exists()


@pytest.mark.slow
def test_a_finished_run_whose_newest_checkpoint_is_older_says_it_is_finished(tmp_path):
    """A chain of `--train.halt-after` jobs with `--ckpt.every 0` ends with a finished run whose newest checkpoint is
    the last halt's: the same command once more would train the last segment again. It is refused, naming the
    finished run and where its model is."""
    from algos import grpo

    args = grpo.Args(run_dir=str(tmp_path / "run"))
    args.train.max_steps, args.train.halt_after, args.rollout.batch_size, args.rollout.n_samples = 2, 1, 8, 4
    args.ckpt.every, args.eval.every = 0, 0
    args.logger.quiet, args.logger.tensorboard = True, False
    assert grpo.main(args)["halted"]
    assert grpo.main(args)["steps"] == 2  # resumed and finished; no checkpoint of the last step (--ckpt.every 0)
    with pytest.raises(ValueError, match=r"holds a finished run of 2 steps .*nothing to resume.*step_00000000"):
        grpo.main(args)
