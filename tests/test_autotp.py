"""DeepSpeed AutoTP training (`--ds.tensor-parallel-size N`) on CPU (gloo, fp32): the decoder layers' linears sharded
over N ranks compute what one rank computes, in sft.py, dpo.py (tests/test_dpo.py) and an RL actor (grpo.py, whose
weight sync gathers the shards for the vLLM engine), halted and resumed, as 2 × 2 ranks and at ZeRO 0-3; and the
refusals of what is not built (kto.py and rm.py, LoRA, 4-bit weights, Muon, a checkpoint at another TP size).

Tolerances: two ways of computing one step add the same float32 terms in other orders (a row-parallel layer's
all-reduce sums its halves, the data-parallel mean sums the ranks' shares), `conftest.f32_rtol`; the weights after
Adam steps are compared in norm against the update itself, because Adam divides each element's step by the root of
its squared-gradient average, so an element whose gradient is at rounding level may step anywhere in ±lr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_first_step_agrees, child_env, f32_rtol, ranks_2_vs_1, zero3_other_reference

from core import embedded, models
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig
from core.engine import free_port

REPO = Path(__file__).resolve().parent.parent
SFT = REPO / "algos" / "sft.py"
STEPS, BATCH, TOKENS = 4, 16, 16  # a step: 16 samples of <= 16 tokens


def sft_run(tmp: Path, name: str, nproc: int, *extra: str) -> Path:
    """algos/sft.py for STEPS steps on the tiny model (eval at the start and the end, accuracy included), in one
    process (`nproc` 0) or under torchrun with `nproc` ranks; its run folder."""
    run_dir = tmp / name
    launcher = [sys.executable] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port())]  # fmt: skip
    cmd = [*launcher, str(SFT), "--model.name-or-path", "cleanrlhf/tiny", "--train.max-steps", str(STEPS),
           "--train.batch-size", str(BATCH), "--train.warmup-steps", "0", "--eval.every", str(STEPS),
           "--eval.max-samples", "32", "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir),
           *extra]  # fmt: skip
    out = subprocess.run(cmd, env={**child_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def rows(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in open(run_dir / "metrics.jsonl"):
        r = json.loads(line)
        out.setdefault(r["step"], {}).update(r)
    return out


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    model = models.load_causal_lm(ModelConfig(name_or_path=str(run_dir / "hf")))  # loads in transformers as is
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_same_run(one: Path, other: Path) -> None:
    """Every step's loss and gradient norm, the eval at the start and the end, and the exported weights of `other`
    equal `one`'s up to float32 reordering."""
    a, b = rows(one), rows(other)
    assert sorted(a) == sorted(b) == list(range(STEPS + 1))
    for step in range(STEPS + 1):
        rtol = max(1e-5, f32_rtol(BATCH * TOKENS, updates=step))
        for key in ("loss/sft", "train/grad_norm", "eval/loss", "eval/accuracy"):
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=rtol, abs=1e-6), (key, step, a[step], b[step])
    base = {n: p.detach() for n, p in models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny")).named_parameters()}
    wa, wb = exported(one), exported(other)
    assert wa.keys() == wb.keys() == base.keys()
    for n in wa:  # the same shapes (whole, gathered), and the same step in norm
        assert wa[n].shape == wb[n].shape == base[n].shape, n
        moved = (wa[n] - base[n]).norm()
        assert moved > 0, f"{n} did not train"
        assert (wb[n] - wa[n]).norm() <= 1e-2 * moved, (n, (wb[n] - wa[n]).norm().item(), moved.item())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    embedded.ensure_tiny_base()
    return sft_run(tmp_path_factory.mktemp("autotp"), "one", 0, "--ds.zero-stage", "0")


@pytest.mark.slow
def test_sft_tensor_parallel_2_halted_and_resumed_equals_one_rank(one_rank, tmp_path):
    """TP=2 over 2 ranks (ZeRO-1), halted after 2 steps (a checkpoint of each rank's shards) and resumed, trains,
    evaluates (greedy generation through the sharded layers) and exports (the shards gathered into a whole HF model)
    what one rank does uninterrupted; resumed at TP=1 in between, with `--ckpt.allow-changes`, it is refused."""
    tp = ("--ds.tensor-parallel-size", "2", "--ds.zero-stage", "1")
    halted = sft_run(tmp_path, "tp2", 2, *tp, "--train.halt-after", "2", "--ckpt.every", "0")
    assert sorted(rows(halted)) == [0, 1, 2] and not (halted / "hf").exists()
    shards = sorted(p.name for p in (halted / "checkpoints").glob("step_*/model/mp_rank_*_model_states.pt"))
    assert shards == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # each rank's half of the layers
    # at TP 1 DeepSpeed cannot load the halves (its AssertionError: key ... is not found): refused, naming both flags
    with pytest.raises(AssertionError, match=r"saved with --ds.tensor-parallel-size 2, resumed with 1; "
                                             r"--ckpt.allow-changes cannot change it"):  # fmt: skip
        sft_run(tmp_path, "tp2", 0, "--ds.zero-stage", "1", "--ckpt.allow-changes")
    resumed = sft_run(tmp_path, "tp2", 2, *tp)
    logged = [json.loads(line)["step"] for line in open(resumed / "metrics.jsonl")]
    assert logged == list(range(STEPS + 1))  # steps 3 and 4 from the checkpoint, not a second run from step 0
    assert_same_run(one_rank, resumed)


@pytest.mark.slow
def test_sft_two_tensor_parallel_groups_of_2_equal_one_rank(one_rank, tmp_path):
    """4 ranks as 2 data-parallel × 2 tensor-parallel (ZeRO-0: the gradient norm and clipping that core computes for
    a TP group) give one rank's run."""
    assert_same_run(one_rank, sft_run(tmp_path, "tp2x2", 4, "--ds.tensor-parallel-size", "2", "--ds.zero-stage", "0"))


@pytest.mark.slow
def test_grpo_actor_with_tensor_parallel_2_halted_and_resumed_trains_like_one_process(tmp_path):
    """`--train.ranks 2 --ds.tensor-parallel-size 2`: the actor's layers sharded over both Ray ranks, each shard
    under ZeRO-3 (gathered over ZeRO's data-parallel group, then over the TP group for the weight sync), a ZeRO-3
    reference beside it, halted after the first step (a checkpoint of each rank's shards) and resumed for the second:
    both steps' losses, gradient norm and KL are one uninterrupted process's, and `--debug` checks after every sync
    (the resumed run's first included) that the engine, which got the gathered shards, computes the trainer's
    log-probs."""
    from algos.grpo import Args, main

    def configure(args, ranks: int) -> None:
        zero3_other_reference(args, ranks)
        args.ds.tensor_parallel_size = ranks  # ranks_2_vs_1: --ds.zero-stage 3
        if ranks == 2:  # the first step here, halted; ranks_2_vs_1's own run of the same args resumes it
            args.train.halt_after = 1
            assert main(args)["halted"]
            shards = sorted(p.name for p in Path(args.run_dir).glob("checkpoints/step_*/actor/*model_states.pt"))
            assert [n[n.index("mp_rank_") :] for n in shards] == [f"mp_rank_0{t}_model_states.pt" for t in (0, 1)]
            args.train.halt_after = None

    rows = ranks_2_vs_1(Args, main, tmp_path, configure)
    assert_first_step_agrees(rows)
    assert [r["step"] for r in rows[2]] == [1, 2]  # step 2 from the checkpoint, not a second run from step 0
    for key in ("loss/policy", "train/grad_norm", "loss/clipfrac", "loss/kl"):
        assert rows[2][1][key] == pytest.approx(rows[1][1][key], rel=max(1e-4, f32_rtol(16 * 8 * 16, updates=1)),
                                                abs=1e-6), key  # fmt: skip


@pytest.mark.slow
def test_grpo_two_tensor_parallel_groups_of_2_at_zero2_train_like_one_process(tmp_path):
    """`--train.ranks 4 --ds.tensor-parallel-size 2 --ds.zero-stage 2`: 2 data-parallel × 2 tensor-parallel Ray ranks,
    ZeRO-2 partitioning each shard's gradients and optimizer states over the 2 data-parallel ranks, a ZeRO-3 reference
    over the 4, give one process's first-step losses, gradient norm and KL."""
    from algos.grpo import Args, main

    def configure(args, ranks: int) -> None:
        zero3_other_reference(args, ranks)
        if ranks == 2:  # ranks_2_vs_1's multi-rank run, here 4 ranks
            args.train.ranks, args.ds.tensor_parallel_size, args.ds.zero_stage = 4, 2, 2
            args.ray.num_cpus = 6  # logical CPUs: four ranks and the engine, as ranks_2_vs_1 gives two

    assert_first_step_agrees(ranks_2_vs_1(Args, main, tmp_path, configure))


def test_the_data_split_gives_a_tensor_parallel_group_one_share():
    assert ds_engine.tp_data_split(DSConfig()) == (0, 1)  # one process, no TP
    with pytest.raises(ValueError, match=r"--ds.tensor-parallel-size 2: must divide the number of ranks \(1\)"):
        ds_engine.tp_data_split(DSConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="--ds.tensor-parallel-size 2 with --train.sp-size 2"):
        ds_engine.tp_data_split(DSConfig(tensor_parallel_size=2), sp_size=2)


WRAPPED = (r"--ds.tensor-parallel-size 2 with LoRA or 4-bit weights \(--model.lora-rank / --model.load-in-4bit; "
           r"--actor.model.lora-rank / --actor.model.load-in-4bit in the RL scripts\)")


@pytest.mark.parametrize("model, ds, message", [
    ({"lora_rank": 4}, {}, WRAPPED),
    ({"load_in_4bit": True, "lora_rank": 4}, {}, WRAPPED),  # QLoRA: a trained 4-bit body needs its adapters
    ({}, {"optimizer": "muon"}, "--ds.tensor-parallel-size 2 with --ds.optimizer muon: Muon orthogonalises whole"),
], ids=["lora", "qlora", "muon"])  # fmt: skip
def test_tensor_parallel_with_lora_4bit_or_muon_is_refused_naming_the_flags(tiny_path, model, ds, message):
    """What AutoTP cannot shard is refused by `make_engine` before DeepSpeed starts: PEFT's and bitsandbytes' wrapped
    linears, and Muon, whose orthogonalisation needs each matrix whole."""
    loaded = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), **model))  # its own: PEFT wraps in place
    assert models.is_4bit(loaded) == ("load_in_4bit" in model)
    with pytest.raises(ValueError, match=message):
        ds_engine.make_engine(loaded, DSConfig(tensor_parallel_size=2, **ds), 1e-3)


def test_sft_refuses_a_tensor_parallel_size_the_ranks_cannot_hold(tmp_path):
    out = subprocess.run([sys.executable, str(SFT), "--model.name-or-path", "cleanrlhf/tiny", "--train.max-steps", "1",
                          "--ds.tensor-parallel-size", "2", "--run-dir", str(tmp_path / "r"), "--logger.quiet"],
                         env=child_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode != 0
    assert "--ds.tensor-parallel-size 2: must divide the number of ranks (1)" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kto", "rm"])
def test_kto_and_rm_with_tensor_parallel_2_log_and_export_what_one_rank_does(name, tmp_path):
    """kto.py and rm.py under torchrun with 2 ranks as one AutoTP group (both ranks take every example, each holds
    half of every layer): the reference log-probs, the KL reference point, the losses, gradient norms and held-out
    metrics of one process at every step, and an export of the whole (gathered) weights."""
    from safetensors.torch import load_file

    common = ["--train.max-steps", "2", "--train.batch-size", "16", "--train.warmup-steps", "0", "--eval.every", "2",
              "--eval.max-samples", "50", "--logger.quiet", "--logger.no-tensorboard"]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]  # fmt: skip
    script = str(REPO / "algos" / f"{name}.py")
    runs = {"one": [sys.executable, script], "tp": [*torchrun, script, "--ds.zero-stage", "1",
                                                     "--ds.tensor-parallel-size", "2"]}  # fmt: skip
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    for run, cmd in runs.items():
        out = subprocess.run([*cmd, *common, "--run-dir", str(tmp_path / run)], env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
    one, tp = rows(tmp_path / "one"), rows(tmp_path / "tp")
    assert sorted(one) == sorted(tp) == [0, 1, 2]
    for step in one:
        keys = [k for k in one[step] if k.split("/")[0] in ("loss", "train", "eval")]
        assert keys and sorted(keys) == sorted(k for k in tp[step] if k.split("/")[0] in ("loss", "train", "eval"))
        for key in keys:
            assert tp[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (key, step)
    wa, wb = (load_file(tmp_path / run / "hf" / "model.safetensors") for run in runs)
    assert wa.keys() == wb.keys() and all(wa[k].shape == wb[k].shape for k in wa)  # whole tensors, not shards
