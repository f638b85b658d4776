"""`--actor.ema-beta`: the moving average of the trained weights, its closed form, its export, ZeRO-3 partitions,
checkpoints and an RL run that halts and resumes."""

from __future__ import annotations

import json

import pytest
import torch

from core import checkpoint, models
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig
from core.ema import local_weights
from core.weights import gathered_state_dict


def tiny():
    torch.manual_seed(0)
    return models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny", dtype="fp32"))


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in gathered_state_dict(engine).items()}


def train(engine, steps: int, first: int = 0) -> None:
    ids = torch.randint(3, 20, (8, 12), generator=torch.Generator().manual_seed(1))
    for step in range(first, first + steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss)
        ds_engine.optimizer_step(engine, step)


def exported(path) -> dict[str, torch.Tensor]:
    model = models.load_causal_lm(ModelConfig(name_or_path=str(path), dtype="fp32"))
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_one_step_ema_is_the_closed_form_and_exports(tiny_path, tokenizer, tmp_path):
    """ema = β·init + (1 − β)·θ_1 after one step; `export_hf(ema=True)` writes exactly that (from_pretrained loads
    it), and the engine's trained weights are untouched by the export."""
    ds_engine.init_distributed("gloo")
    beta = 0.9
    engine = ds_engine.make_engine(tiny(), DSConfig(zero_stage=0), 1e-2, ema_beta=beta)
    init = weights(engine)
    train(engine, 1)
    after = weights(engine)
    ds_engine.export_hf(engine, tokenizer, tmp_path / "hf_ema", ema=True)
    ema = exported(tmp_path / "hf_ema")
    for k in init:
        assert not torch.equal(init[k], after[k]), k  # the step moved every weight
        torch.testing.assert_close(ema[k], beta * init[k] + (1 - beta) * after[k], rtol=1e-6, atol=1e-7, msg=k)
    now = weights(engine)
    assert all(torch.equal(now[k], after[k]) for k in after)  # the trained weights came back bit for bit


def test_ema_after_a_few_steps_differs_from_initial_and_final(tiny_path, tokenizer, tmp_path):
    ds_engine.init_distributed("gloo")
    beta = 0.5
    engine = ds_engine.make_engine(tiny(), DSConfig(zero_stage=0), 1e-2, ema_beta=beta)
    expected = weights(engine)
    init = dict(expected)
    for step in range(3):
        train(engine, 1, step)
        now = weights(engine)
        expected = {k: beta * expected[k] + (1 - beta) * now[k] for k in now}
    ds_engine.export_hf(engine, tokenizer, tmp_path / "hf", ema=False)
    ds_engine.export_hf(engine, tokenizer, tmp_path / "hf_ema", ema=True)
    final, ema = exported(tmp_path / "hf"), exported(tmp_path / "hf_ema")
    for k in init:
        assert not torch.equal(ema[k], init[k]) and not torch.equal(ema[k], final[k]), k
        torch.testing.assert_close(ema[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)


def test_zero3_ema_holds_this_ranks_partition_and_exports_like_zero0(tiny_path, tokenizer, tmp_path):
    ds_engine.init_distributed("gloo")
    out = {}
    for stage in (0, 3):
        engine = ds_engine.make_engine(tiny(), DSConfig(zero_stage=stage), 1e-2, ema_beta=0.7)
        train(engine, 2)
        if stage == 3:  # flat partitions of the size each rank holds, not full copies
            for name, p in engine.module.named_parameters():
                assert engine.ema[name].dim() == 1 and engine.ema[name].numel() == p.ds_tensor.numel(), name
        ds_engine.export_hf(engine, tokenizer, tmp_path / f"ema{stage}", ema=True)
        out[stage] = exported(tmp_path / f"ema{stage}")
    for k in out[0]:  # the trained weights themselves differ by ~3e-5 (float summation order)
        torch.testing.assert_close(out[3][k], out[0][k], rtol=1e-3, atol=1e-4, msg=k)


@pytest.mark.parametrize("stage", [0, 3])
def test_ema_survives_a_checkpoint(tiny_path, tmp_path, stage):
    """Save after 2 steps, train 2 more; a fresh engine loading the checkpoint ends with the same EMA, bit for bit."""
    ds_engine.init_distributed("gloo")
    a = ds_engine.make_engine(tiny(), DSConfig(zero_stage=stage), 1e-2, ema_beta=0.8)
    train(a, 2)
    checkpoint.save({"model": a}, tmp_path, 1, {"step": 1})
    train(a, 2, 2)
    b = ds_engine.make_engine(tiny(), DSConfig(zero_stage=stage), 1e-2, ema_beta=0.8)
    checkpoint.load({"model": b}, tmp_path / "step_00000001")
    train(b, 2, 2)
    assert a.ema.keys() == b.ema.keys() and all(torch.equal(a.ema[k], b.ema[k]) for k in a.ema)
    # a checkpoint saved without an EMA: the EMA starts at the restored weights
    c = ds_engine.make_engine(tiny(), DSConfig(zero_stage=stage), 1e-2, ema_beta=0.8)
    for f in (tmp_path / "step_00000001").glob("ema_*"):
        f.unlink()
    checkpoint.write_manifest(tmp_path / "step_00000001")
    checkpoint.load({"model": c}, tmp_path / "step_00000001")
    local = local_weights(c)
    assert all(torch.equal(c.ema[k], local[k].float()) for k in local)


@pytest.mark.slow
def test_grpo_with_ema_exports_it_and_resumes_exactly(tmp_path, one_thread):
    """GRPO, 2 steps with --actor.ema-beta 0.5: straight, and halted after step 1 then resumed. <run>/hf_ema loads,
    differs from <run>/hf and from the warm start, and is the same for both runs."""
    from algos import grpo

    def small(run_dir):
        args = grpo.Args()
        args.train.max_steps, args.rollout.batch_size, args.train.micro_batch_size = 2, 16, 64
        args.eval.every, args.eval.max_samples, args.eval.best_metric = 0, 16, None
        args.logger.quiet, args.logger.tensorboard = True, False
        args.actor.ema_beta, args.run_dir = 0.5, str(run_dir)
        return args

    grpo.main(small(tmp_path / "straight"))
    part = small(tmp_path / "part")
    part.train.halt_after = 1
    assert grpo.main(part)["halted"]
    part.train.halt_after = None
    grpo.main(part)
    trained = [json.loads(line)["step"] for line in open(tmp_path / "part" / "metrics.jsonl") if "loss/" in line]
    assert trained == [1, 2]
    init = exported("cleanrlhf/tiny-sft")  # the embedded warm start the run began from
    ema, final = exported(tmp_path / "straight" / "hf_ema"), exported(tmp_path / "straight" / "hf")
    resumed = exported(tmp_path / "part" / "hf_ema")
    for k in ema:
        assert not torch.equal(ema[k], init[k]) and not torch.equal(ema[k], final[k]), k
        torch.testing.assert_close(resumed[k], ema[k], rtol=1e-5, atol=1e-6, msg=k)
