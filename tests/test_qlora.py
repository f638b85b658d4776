"""QLoRA (`--model.load-in-4bit` / `--actor.model.load-in-4bit` with a LoRA rank): the frozen base in 4-bit NF4
(bitsandbytes' CPU kernels here), adapters in fp32. What the engines and the HF export receive is the dequantized base
with the adapters merged, i.e. exactly what the trainer's 4-bit linears compute with; SFT learns and resumes exactly;
GRPO learns with the engine checked against the trainer after every sync, in both LoRA sync modes."""

from __future__ import annotations

import json
import types

import pytest
import torch

from core import engine as ds_engine
from core import models, weights
from core.config import DSConfig, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

PROBES = torch.tensor([[1, 5, 6, 14, 7, 8, 15, 5, 6, 9, 2], [1, 9, 9, 14, 9, 15, 1, 8, 8, 2, 0]])


def qlora(path: str, seed: int = 0):
    """The tiny model's linears in 4-bit with rank-8 adapters, lora_B random (PEFT starts it at 0)."""
    model = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32", lora_rank=8, load_in_4bit=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def float32_error(model, inputs) -> float:
    """How far `model`'s float32 logits on `inputs` are from the same model's in float64: the rounding one float32
    evaluation of it costs (measured 4.3e-7 on the tiny model's logits of ~0.8, 2026-12-05), the scale of any two
    float32 evaluations of one function disagreeing by order of summation alone."""
    import copy

    with torch.no_grad():
        exact = copy.deepcopy(model).double()(inputs)[0]
        return (model(inputs)[0].double() - exact).abs().max().item()


def test_a_4bit_model_computes_and_trains_the_same_after_an_eval_on_an_avx512_bf16_cpu(tiny_path, monkeypatch):
    """On a CPU with AVX512-BF16 (Zen 4, Sapphire Rapids), bitsandbytes 0.50's Linear4bit repacks its weight into an
    inference-only bf16 layout the first time it runs in eval mode on an input without grad, and then, in training
    too, computes in bf16 through a kernel with no backward (`result += bias` raised "a view of a leaf Variable ...
    in-place operation" at the first update after an eval, and the logits were 5e-3 off the dequantized weights'). The
    loaders switch that path off (`models.no_packed_4bit_inference`). Here the CPU is made to claim the feature, so the
    test fails without the switch on any machine: after an eval pass the weights keep their NF4 layout, the logits stay
    those of the dequantized weights, and a training step's gradients reach every adapter."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    model = qlora(str(tiny_path))
    linears = [m for m in model.modules() if isinstance(m, bnb_modules.Linear4bit)]
    assert linears and not any(m.support_avx512bf16_for_cpu for m in linears)
    with torch.no_grad():
        before = model(PROBES).logits  # eval mode, no grad: where the repacking happened
        again = model(PROBES).logits
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears)
    assert torch.equal(before, again)
    model.train()
    model(PROBES, labels=PROBES).loss.backward()
    adapters = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(g is not None and g.abs().sum() > 0 for g in adapters.values()), [
        n for n, g in adapters.items() if g is None or g.abs().sum() == 0
    ]


def zero0(model):
    return types.SimpleNamespace(module=model, zero_optimization_stage=lambda: 0)


def plain_model(state: dict, like):
    """A plain fp32 HF model of `like`'s architecture holding `state` (HF names)."""
    from transformers import AutoModelForCausalLM

    config = like.get_base_model().config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(like.get_base_model().config).from_dict(config), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("lm_head.weight") for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def test_4bit_without_lora_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match=r"^--actor\.model\.load-in-4bit needs --actor\.model\.lora-rank > 0"):
        models.load_causal_lm(ModelConfig(load_in_4bit=True), "--actor.model.name-or-path")


def test_rm_refuses_a_4bit_base_without_lora_before_loading_anything(nothing_loads):
    from algos import rm

    args = rm.Args()
    args.model.load_in_4bit = True
    with pytest.raises(ValueError, match=r"^--model\.load-in-4bit needs --model\.lora-rank > 0"):
        rm.main(args)


@pytest.mark.slow
@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
def test_rm_trains_adapters_and_its_head_and_exports_a_plain_scalar_model(four_bit, tmp_path):
    """rm.py with `--model.lora-rank 8` (and a 4-bit body): the adapters and the fresh score head train (PEFT's
    modules_to_save), held-out accuracy rises (measured 0.447 -> 0.667 / 0.673 in 30 steps, 2026-11-29), and the
    export is a plain `AutoModelForSequenceClassification` (adapters merged, NF4 dequantized, no quantization config)
    whose served scores rank the held-out pairs exactly as the trained model's eval did."""
    from transformers import AutoConfig

    from algos import rm
    from core import data
    from rewards.server import RewardScorer

    args = rm.Args(run_dir=str(tmp_path / "run"))
    args.model.lora_rank, args.model.load_in_4bit = 8, four_bit
    args.train.max_steps, args.train.lr, args.eval.every, args.eval.max_samples = 30, 2e-3, 30, 300
    args.logger.quiet, args.logger.tensorboard = True, False
    summary = rm.main(args)
    assert summary["eval_accuracy_last"] >= summary["eval_accuracy_first"] + 0.1, summary
    export = summary["export_dir"]
    assert "quantization_config" not in AutoConfig.from_pretrained(export).to_dict()
    test = [json.loads(line) for line in open(data.resolve_data("cleanrlhf/add2-pref") + "/test.jsonl")][:300]
    scorer = RewardScorer(export)
    chosen = scorer([x["prompt"] + x["chosen"] for x in test])
    rejected = scorer([x["prompt"] + x["rejected"] for x in test])
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(test) == pytest.approx(summary["eval_accuracy_last"],
                                                                                      abs=0.005)  # fmt: skip


def test_4bit_with_zero3_is_refused_naming_the_flags(tiny_path):
    model = qlora(str(tiny_path))
    with pytest.raises(ValueError, match=r"--model\.load-in-4bit with ZeRO-3 \(--ds\.zero-stage 3"):
        ds_engine.make_engine(model, DSConfig(zero_stage=3), 1e-3)


def test_the_engines_get_what_the_4bit_trainer_computes(tiny_path):
    """The merged stream (first sync and export) is the dequantized base + B·A·scaling under HF names: a plain fp32
    model holding it gives the QLoRA model's logits. And it is not the checkpoint's fp32 weights (NF4 rounds them), so
    an engine left with those would compute another policy."""
    from safetensors.torch import load_file

    model = qlora(str(tiny_path))
    assert models.is_4bit(model) and not models.is_4bit(models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path))))
    merged = dict(weights.merged_named_parameters(zero0(model)))
    with torch.no_grad():
        want = model(PROBES).logits
        plain = plain_model(merged, model)
        got = plain(PROBES).logits
    # the same products summed in another order (W x + s·B(A x) against (W + s·BA) x, both float32): each evaluation is
    # off the exact value by about what float32 costs this model, so they differ by at most about twice that
    tolerance = 4 * float32_error(plain, PROBES)
    assert (got - want).abs().max() <= tolerance, ((got - want).abs().max(), tolerance)
    original = load_file(f"{tiny_path}/model.safetensors")
    linear = "model.layers.0.mlp.down_proj.weight"
    assert merged[linear].dtype == torch.float32 and merged[linear].shape == original[linear].shape
    base = weights.dequantized(
        model.get_parameter(f"base_model.model.{linear.replace('.weight', '.base_layer.weight')}")
    )
    error = (base - original[linear]).abs().max() / original[linear].abs().max()
    assert 1e-3 < error < 0.2, error  # NF4's rounding: visible, and bounded by its 16 levels per block


@pytest.mark.slow
def test_qlora_sft_learns_resumes_exactly_and_exports_a_plain_model(tiny_path, tmp_path, monkeypatch):
    """sft.py with a 4-bit base: the eval loss falls, only the adapters change (the packed NF4 codes are the fresh
    load's), halted after 3 steps and resumed it logs the uninterrupted run's losses, and the export is a plain fp32
    model (no quantization config) whose logits are the trained QLoRA model's."""
    from transformers import AutoModelForCausalLM

    from algos import sft

    made = []
    make_engine = ds_engine.make_engine
    monkeypatch.setattr(ds_engine, "make_engine", lambda *a, **k: made.append(make_engine(*a, **k)) or made[-1])

    def run(name: str, halt_after: int | None = None) -> list[float]:
        args = sft.Args()
        args.model.load_in_4bit, args.model.lora_rank = True, 8
        args.train.max_steps, args.train.lr, args.train.halt_after, args.ckpt.every = 6, 1e-3, halt_after, 3
        args.eval.every, args.eval.generate, args.eval.max_samples = 6, False, 64
        args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / name)
        sft.main(args)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    whole = run("whole")
    trained = made[-1].module
    evals = [r["eval/loss"] for r in whole if "eval/loss" in r]
    assert evals[-1] < evals[0] - 0.2, evals
    fresh = dict(models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny", lora_rank=8, load_in_4bit=True))
                 .named_parameters())  # fmt: skip
    for name, p in trained.named_parameters():
        assert torch.equal(p.detach(), fresh[name].detach()) != ("lora_" in name), name  # adapters only
    export = tmp_path / "whole" / "hf"
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert not models.is_4bit(plain)
    with torch.no_grad():
        assert torch.allclose(plain(PROBES).logits, trained.eval()(PROBES).logits, rtol=1e-4, atol=1e-5)

    assert run("halted", halt_after=3) and run("halted") is not None
    resumed = [json.loads(line) for line in (tmp_path / "halted" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss/sft"] for r in resumed if "loss/sft" in r] == [r["loss/sft"] for r in whole if "loss/sft" in r]


@pytest.mark.slow
def test_grpo_with_a_4bit_base_raises_eval_pass_at_1_with_the_engine_checked(tmp_path):
    """GRPO with `--actor.model.load-in-4bit --actor.model.lora-rank 8` (lr 1e-3, the adapters' usual): 12 steps of the
    script's defaults raise greedy pass@1 (0.522 -> 0.728 when measured, 2026-11-29), `--debug` checking after every
    merged sync that the engine computes the trainer's log-probs (the dequantized base + merged adapters)."""
    from conftest import short_rl_run

    from algos.grpo import Args, main

    args = Args()
    args.actor.model.load_in_4bit, args.actor.model.lora_rank, args.actor.lr = True, 8, 1e-3
    summary, rows = short_rl_run(main, args, tmp_path / "run", steps=12)
    assert sum("perf/debug_check_s" in r for r in rows) == 12  # the check ran after every sync (and passed)
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary


@pytest.mark.slow
def test_grpo_4bit_adapter_sync_sends_the_dequantized_base_once_then_adapters(tmp_path):
    """`--vllm.lora-sync adapter` with a 4-bit base and a KL term (the reference: the actor with adapters off): the
    engine, started from the full-precision checkpoint, gets the dequantized base at the first sync and then only the
    factors; `--debug`'s check passes after each."""
    from algos.grpo import Args, main

    args = Args()
    args.actor.model.load_in_4bit, args.actor.model.lora_rank, args.actor.lr = True, 8, 1e-3
    args.vllm.lora_sync, args.algo.kl_coef, args.debug = "adapter", 0.01, True
    args.train.max_steps, args.rollout.batch_size, args.eval.every = 3, 16, 0
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / "run")
    main(args)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "sync/mb" in r]
    assert len(synced) == 3 and all("perf/debug_check_s" in r for r in synced)
    assert synced[0]["sync/mb"] > 5 * synced[1]["sync/mb"] and synced[1]["sync/mb"] == synced[2]["sync/mb"]
    assert all(0 <= r["loss/kl"] < 1 for r in rows if "loss/kl" in r)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["dpo", "kto"])
def test_preference_scripts_train_a_4bit_base(script, tmp_path):
    """dpo.py and kto.py with `--model.load-in-4bit --model.lora-rank 8`: their reference is the 4-bit base (the
    adapters start at 0), and 3 steps raise the eval preference accuracy from 0.5 (0.684 and 0.688 when measured)."""
    import importlib

    module = importlib.import_module(f"algos.{script}")
    args = module.Args()
    args.model.load_in_4bit, args.model.lora_rank = True, 8
    args.train.max_steps, args.eval.every = 3, 3
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / script)
    summary = module.main(args)
    assert summary["eval_pref_accuracy_first"] == 0.5 and summary["eval_pref_accuracy_last"] >= 0.6, summary
    assert "quantization_config" not in json.loads((tmp_path / script / "hf" / "config.json").read_text())


def holds_the_dequantized_weights(four, full, inputs) -> None:
    """A frozen 4-bit model computes what `full`'s architecture computes with the dequantized NF4 weights (loaded into
    a copy of `full`): the same products summed in another order, float32 rounding of 128-term sums; and that is not
    what `full` computes (NF4 rounded its weights)."""
    import copy

    plain = copy.deepcopy(full)
    missing, unexpected = plain.load_state_dict({n: weights.dequantized(p) for n, p in four.named_parameters()},
                                                strict=False)  # fmt: skip
    assert not unexpected and all(k.endswith("lm_head.weight") for k in missing), (missing, unexpected)
    with torch.no_grad():
        got, want, before = four(input_ids=inputs)[0], plain(input_ids=inputs)[0], full(input_ids=inputs)[0]
    # one path on every CPU (dequantize, then F.linear): measured equal bit for bit; float32's order at most
    tolerance = 4 * float32_error(plain, inputs)
    assert (got - want).abs().max() <= tolerance, ((got - want).abs().max(), tolerance)
    assert not torch.allclose(got, before, rtol=1e-3, atol=1e-3)


def test_frozen_models_load_in_4bit_without_lora_and_compute_with_their_nf4_weights(tiny_path, tmp_path):
    """--ref.load-in-4bit, --teacher.load-in-4bit, --reward.load-in-4bit: frozen models need no adapters; each loads
    its linears in NF4 (the reward model's score head stays fp32) and computes with those rounded weights."""
    from algos import opd
    from core import rl
    from core.config import RefConfig
    from rewards.remote import ModelReward

    tiny_path = str(tiny_path)
    full = models.load_causal_lm(ModelConfig(name_or_path=tiny_path, dtype="fp32")).eval()
    ref = rl.load_ref(RefConfig(name_or_path=tiny_path, load_in_4bit=True), ModelConfig(dtype="fp32"),
                      device=torch.device("cpu"))  # fmt: skip
    assert models.is_4bit(ref) and not any(p.requires_grad for p in ref.parameters())
    holds_the_dequantized_weights(ref, full, PROBES)
    args = opd.Args()
    args.teacher.model, args.teacher.load_in_4bit, args.actor.model.dtype = tiny_path, True, "fp32"
    assert models.is_4bit(opd.load_teacher(args, torch.device("cpu")))
    with pytest.raises(ValueError, match="4-bit frozen model .* zero-stage 3"):
        rl.load_ref(RefConfig(name_or_path=tiny_path, zero_stage=3, load_in_4bit=True), ModelConfig(dtype="fp32"),
                    device=torch.device("cpu"))  # fmt: skip

    torch.manual_seed(0)  # a reward model with a fixed random head, saved as rm.py exports one
    models.load_scalar_model(tiny_path, "fp32").save_pretrained(tmp_path / "rm")
    models.load_tokenizer(tiny_path).save_pretrained(tmp_path / "rm")
    four = ModelReward(str(tmp_path / "rm"), load_in_4bit=True).scorer.model
    assert models.is_4bit(four) and four.score.weight.dtype == torch.float32
    holds_the_dequantized_weights(four, models.load_scalar_model(str(tmp_path / "rm"), "fp32").eval(), PROBES[:1])


@pytest.mark.slow
def test_grpo_with_a_4bit_reference_measures_the_kl_to_the_rounded_policy(tmp_path):
    """`--ref.load-in-4bit` with the KL on: at the first step the actor is still its starting model, so the KL to the
    4-bit reference is NF4's rounding alone: above 0 (a full-precision reference gives 0 there) and small."""
    from algos.grpo import Args, main

    args = Args()
    args.algo.kl_coef, args.ref.load_in_4bit = 0.05, True
    args.train.max_steps, args.rollout.batch_size, args.eval.every = 1, 16, 0
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / "run")
    main(args)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 1e-4 < row["loss/kl"] < 0.05, row["loss/kl"]
