"""End-to-end tests of algos/sft.py on real DeepSpeed (gloo on CPU): learning, ZeRO-3 over 2 ranks, exact resume,
the CLI, and the embedded warm start that the RL scripts start from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env as clean_env

from algos.sft import Args, main
from core import embedded, models
from core import engine as ds_engine

REPO = Path(__file__).resolve().parent.parent
SFT = REPO / "algos" / "sft.py"


def small_args(tmp_path: Path, **train) -> Args:
    args = Args()
    args.model.name_or_path = "cleanrlhf/tiny"
    args.logger.quiet = True
    args.logger.tensorboard = False
    args.run_dir = str(tmp_path / "run")
    args.eval.generate = False
    args.eval.max_samples = 64
    args.train.warmup_steps = 0
    for k, v in train.items():
        setattr(args.train, k, v)
    return args




def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss/sft"] for m in metrics(run_dir) if "loss/sft" in m}


def test_sft_lowers_eval_loss_and_changes_every_parameter(tmp_path):
    args = small_args(tmp_path, max_steps=12, batch_size=32)
    args.eval.every = 12
    summary = main(args)
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 0.5, summary
    base = models.load_causal_lm(models.ModelConfig(name_or_path="cleanrlhf/tiny"))
    tuned = models.load_causal_lm(models.ModelConfig(name_or_path=summary["export_dir"]))
    before, after = dict(base.named_parameters()), dict(tuned.named_parameters())
    assert before.keys() == after.keys()
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    from safetensors import safe_open

    with safe_open(str(Path(summary["export_dir"]) / "model.safetensors"), "pt") as f:  # tied head stored once
        assert "lm_head.weight" not in list(f.keys())


@pytest.mark.slow
def test_sft_runs_again_after_the_world_was_destroyed(tmp_path):
    """An in-process vLLM engine destroys the default process group at shutdown; the next run must still work."""
    import torch.distributed as dist

    args = small_args(tmp_path / "a", max_steps=2, batch_size=16)
    args.eval.every = 0
    main(args)
    dist.destroy_process_group()
    args = small_args(tmp_path / "b", max_steps=2, batch_size=16)
    args.eval.every = 0
    assert main(args)["steps"] == 2


def _torchrun(nproc: int, tmp: Path, *extra: str) -> Path:
    run_dir = tmp / f"run{nproc}"
    env = {**clean_env(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(29500 + nproc + os.getpid() % 1000), str(SFT), "--model.name-or-path", "cleanrlhf/tiny",
           "--train.max-steps", "4", "--train.batch-size", "32", "--train.warmup-steps", "0", "--eval.every", "0",
           "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir), *extra]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, timeout=600)
    return run_dir


@pytest.mark.slow
def test_zero3_world_size_2_matches_world_size_1(tmp_path):
    embedded.ensure_tiny_base()
    one = losses(_torchrun(1, tmp_path, "--ds.zero-stage", "3"))
    two = losses(_torchrun(2, tmp_path, "--ds.zero-stage", "3"))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:  # same global batch, same global token mean: only float summation order differs
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), (step, one, two)
    assert one[4] < one[1]


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = small_args(tmp_path / "full", max_steps=6, batch_size=32)
    full.eval.every = 0
    main(full)
    expected = losses(full.run_dir)

    part = small_args(tmp_path / "part", max_steps=6, batch_size=32, halt_after=3)
    part.eval.every, part.ckpt.every = 0, 3
    assert main(part)["halted"]
    assert sorted(losses(part.run_dir)) == [1, 2, 3]
    part.train.halt_after = None
    main(part)  # same --run-dir: resumes from the step-3 checkpoint
    resumed = losses(part.run_dir)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), (step, expected, resumed)


@pytest.mark.slow
def test_checkpoint_keeps_last_k_and_latest_is_complete(tmp_path):
    args = small_args(tmp_path, max_steps=6, batch_size=16)
    args.eval.every, args.ckpt.every, args.ckpt.keep_last = 0, 2, 2
    main(args)
    ckpt = Path(args.run_dir) / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000003", "step_00000005"]
    assert (ckpt / "latest").read_text() == "step_00000005"
    assert not list(ckpt.glob(".tmp_*"))


def test_help_documents_every_section():
    out = subprocess.run([sys.executable, str(SFT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model.name-or-path", "--data.path", "--data.input-key", "--ds.zero-stage", "--train.lr",
                 "--ckpt.every", "--logger.wandb", "--eval.stop-at-accuracy"):  # fmt: skip
        assert flag in out.stdout, flag
    assert "peak learning rate" in out.stdout


@pytest.mark.slow
def test_copied_script_runs_from_another_directory_and_names_its_runs(tmp_path):
    copy = tmp_path / "my_sft.py"
    shutil.copy(SFT, copy)
    env = clean_env()
    cmd = [sys.executable, str(copy), "--model.name-or-path", "cleanrlhf/tiny", "--train.max-steps", "2",
           "--eval.every", "0", "--logger.quiet", "--logger.run-root", str(tmp_path / "runs")]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1 and runs[0].name.startswith("my_sft__1__"), runs
    # without --run-dir, the libraries' messages go beside the run folder (core/noise.py): named by the copy too
    assert [p.name.split(".")[0] for p in (tmp_path / "runs").glob("*.log")] == ["my_sft"]


@pytest.mark.slow
def test_warm_start_has_partial_accuracy():
    """The RL warm start `cleanrlhf/tiny-sft` solves some but not most of the held-out task."""
    path = embedded.ensure_sft_warm_start()
    tokenizer = models.load_tokenizer(str(path))
    model = models.load_causal_lm(models.ModelConfig(name_or_path=str(path)))
    _, test = embedded.task_rows(2)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in test]
    outs = models.greedy_generate(model, tokenizer, prompts, max_new_tokens=5)
    acc = sum(tokenizer.decode(o, skip_special_tokens=True) == r["answer"] for o, r in zip(outs, test)) / len(test)
    assert 0.2 <= acc <= 0.6, acc


@pytest.mark.slow
@pytest.mark.parametrize(
    "option",
    ["lora", "offload_optimizer", "gradient_checkpointing", "bf16", "zero3", "wandb_offline", "no_packing"],
)
def test_sft_engine_options_train_and_export(tmp_path, option, monkeypatch):
    """Every engine option of the foundation trains (loss falls over a few steps) and exports a loadable model."""
    args = small_args(tmp_path, max_steps=6, batch_size=32)
    args.eval.every = 0
    if option == "lora":
        args.model.lora_rank, args.model.lora_alpha = 8, 16
        args.train.lr = 1e-2
    elif option == "offload_optimizer":
        args.ds.offload_optimizer = True
    elif option == "gradient_checkpointing":
        args.model.gradient_checkpointing = True
    elif option == "bf16":
        args.model.dtype = "bf16"
    elif option == "zero3":
        args.ds.zero_stage = 3
    elif option == "wandb_offline":
        monkeypatch.setenv("WANDB_DIR", str(tmp_path))
        args.logger.wandb, args.logger.wandb_mode = True, "offline"
    elif option == "no_packing":
        args.train.packing = False
    summary = main(args)
    steps = losses(args.run_dir)
    assert steps[6] < steps[1], steps
    exported = models.load_causal_lm(models.ModelConfig(name_or_path=summary["export_dir"]))
    base = models.load_causal_lm(models.ModelConfig(name_or_path="cleanrlhf/tiny"))
    changed = [n for n, p in base.named_parameters() if not torch.equal(p, dict(exported.named_parameters())[n])]
    assert changed, "export equals the untrained model"
    if option == "lora":  # merged LoRA changes only the adapted linear layers, never embeddings or norms
        assert all("proj" in n for n in changed), changed
    if option == "wandb_offline":
        assert list(Path(args.run_dir).rglob("*.wandb")), "no offline W&B run written"


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and ds_engine.cpp_compiler() is None, reason="needs g++ on CPU")
def test_compiled_engine_trains_like_the_eager_one(tmp_path):
    """--ds.compile gives the eager losses step for step (same seed and batches), and the eval's HF generation and
    the HF export still work on the compiled model (its parameter names are unchanged)."""
    runs = {}
    for compiled in (False, True):
        args = small_args(tmp_path / str(compiled), max_steps=4, batch_size=32)
        args.eval.every, args.eval.generate, args.eval.max_samples = 4, True, 16
        args.ds.compile = compiled
        summary = main(args)
        runs[compiled] = losses(args.run_dir), summary
    (eager, eager_summary), (compiled, compiled_summary) = runs[False], runs[True]
    assert eager.keys() == compiled.keys() == {1, 2, 3, 4}
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4), (step, eager, compiled)
    assert compiled_summary["eval_accuracy_last"] == eager_summary["eval_accuracy_last"]
    exported = models.load_causal_lm(models.ModelConfig(name_or_path=compiled_summary["export_dir"]))
    reference = models.load_causal_lm(models.ModelConfig(name_or_path=eager_summary["export_dir"]))
    # Adam normalises each update, so a near-zero gradient that differs in the last bits moves a weight by up to lr
    # either way: weights agree to a fraction of the 4 steps' total movement (4 * lr = 0.012), not to 1e-5
    for (name, p), (ref_name, q) in zip(exported.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name and (p - q).abs().max() < 2e-3, (name, (p - q).abs().max())


def test_compile_without_a_cpp_compiler_is_a_clear_error(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the check is for CPU, where torch.compile writes C++ kernels")
    monkeypatch.setattr(ds_engine, "cpp_compiler", lambda: None)
    args = small_args(tmp_path, max_steps=1, batch_size=8)
    args.ds.compile = True
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        main(args)
