"""LoRA in the RL scripts (`--actor.model.lora-rank N`): what the engines receive after each update (`--vllm.lora-sync
merged`: the merged weights under HF names, after the first sync only the adapted linears; `adapter`: the factors as a
vLLM LoRA adapter, a new one per sync), that the engines then compute the trainer's log-probs, and that the reference
policy of the KL term is the actor with its adapters switched off (no second model)."""

from __future__ import annotations

import copy
import json
import os
import types

import pytest
import torch

from core import engine as ds_engine
from core import models, placement, rollout, vllm_engine, weights
from core.config import DSConfig, ModelConfig

PROBES = [[1, 5, 6, 14, 7, 8, 15, 5, 6, 9, 2], [1, 9, 9, 14, 9, 15, 1, 8, 8, 2]]


def lora_model(path, rank: int = 8, seed: int = 0):
    """The tiny model with LoRA on every linear, lora_B random (PEFT starts it at 0: the adapters would do nothing)."""
    model = models.load_causal_lm(ModelConfig(name_or_path=str(path), dtype="fp32", lora_rank=rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def zero0(model):
    """What the sync functions read of a ZeRO-0 DeepSpeed engine: the module and the stage."""
    return types.SimpleNamespace(module=model, zero_optimization_stage=lambda: 0)


def adapted_linears(model) -> set[str]:
    return {weights.hf_name(name) for name in weights.lora_modules(model)}


def test_merged_weights_are_peft_merge_under_hf_names_and_leave_the_module_untouched(tiny_path):
    model = lora_model(tiny_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = dict(weights.merged_named_parameters(zero0(model)))
    for name, p in model.named_parameters():  # merged on copies: the trained module is bit-identical
        assert torch.equal(p, before[name]), name
    expected = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert merged.keys() == expected.keys()  # HF names (model.layers.0.self_attn.q_proj.weight), no PEFT ones
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(merged[f"{m}.weight"], before[f"base_model.model.{m}.base_layer.weight"])
               for m in adapted_linears(model))  # fmt: skip
    # after the first sync only the adapted linears (weight and bias, whole vLLM modules) change
    changed = dict(weights.merged_named_parameters(zero0(model), changed_only=True))
    assert {n.rsplit(".", 1)[0] for n in changed} == adapted_linears(model)
    assert "model.layers.0.self_attn.q_proj.bias" in changed  # Qwen2's q/k/v biases travel with their weights
    assert not any("norm" in n or "embed" in n for n in changed)
    for name, value in changed.items():
        assert torch.equal(value, merged[name]), name


def test_a_model_without_lora_syncs_every_parameter(tiny_model):
    named = dict(weights.merged_named_parameters(zero0(tiny_model), changed_only=True))
    assert named.keys() == dict(tiny_model.named_parameters()).keys()


def test_adapter_tensors_are_a_saved_peft_adapter(tiny_path, tmp_path):
    from peft import get_peft_model_state_dict

    model = lora_model(tiny_path)
    sent = dict(weights.adapter_named_parameters(zero0(model)))
    saved = get_peft_model_state_dict(model)
    assert sent.keys() == saved.keys() and sent
    for name, value in saved.items():
        assert torch.equal(sent[name], value), name
    config = weights.adapter_config(model)
    assert config["r"] == 8 and config["lora_alpha"] == 16
    json.dumps(config)  # adapter_config.json
    assert len(config["target_modules"]) == 7  # all-linear, resolved: q k v o gate up down


def _grpo_args(tiny_path, kl_coef: float = 0.05):
    from algos.grpo import Args

    args = Args()
    args.actor.model.name_or_path, args.actor.model.lora_rank, args.algo.kl_coef = str(tiny_path), 8, kl_coef
    return args


def test_lora_reference_is_the_actor_with_adapters_off(tiny_path, tiny_model, monkeypatch):
    from core import rl

    ds_engine.init_distributed("gloo")
    actor = ds_engine.make_engine(lora_model(tiny_path), DSConfig(zero_stage=0), 1e-3)
    args = _grpo_args(tiny_path)

    def no_second_model(*a, **k):
        raise AssertionError("a LoRA actor's reference must not load a model")

    monkeypatch.setattr(rl, "load_ref", no_second_model)
    monkeypatch.setattr(models, "load_causal_lm", no_second_model)
    monkeypatch.setattr(ds_engine, "make_frozen", no_second_model)
    ref = rl.make_ref(args.ref, args.actor.model, torch.device("cpu"), None, actor)
    assert isinstance(ref, ds_engine.AdaptersOff) and ref.module is actor.module  # the actor's weights, no copy
    batch = {**collate(PROBES), "packed": True}
    with torch.no_grad():
        on = rl.forward_logp(actor, batch, 1.0)[0]
        ref_logp = rl.forward_logp(ref, batch, 1.0)[0]
        base = rl.forward_logp(tiny_model, batch, 1.0)[0]
        again = rl.forward_logp(actor, batch, 1.0)[0]
    torch.testing.assert_close(ref_logp, base, rtol=0, atol=1e-5)  # the base model's log-probs
    assert (on - base).abs().max() > 1e-2  # the adapters do change the policy ...
    assert torch.equal(again, on)  # ... and are on again after the reference's forward
    # a reference of its own (another model, or --ref.ranks) is still loaded
    args.ref.name_or_path = "cleanrlhf/tiny-sft"
    with pytest.raises(AssertionError, match="must not load"):
        rl.make_ref(args.ref, args.actor.model, torch.device("cpu"), None, actor)


def collate(token_ids):
    from core.packing import collate_padded

    return collate_padded([{"input_ids": t, "loss_mask": [0] + [1] * (len(t) - 1)} for t in token_ids], pad_id=0)


def test_merged_sync_first_everything_then_the_adapted_linears(tiny_path):
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, timeout_s=120)
    engines = rollout.create_engines(str(tiny_path), cfg, seed=0)
    try:
        model = lora_model(tiny_path, seed=1)
        actor = zero0(model)
        first = placement.sync_weights(engines, actor, 0)
        assert rollout.check_weights(engines, model, PROBES) < 1e-4  # engine == trainer with the adapters on
        with torch.no_grad():  # an update: only adapter parameters move
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        second = placement.sync_weights(engines, actor, 0)
        assert rollout.check_weights(engines, model, PROBES) < 1e-4
        adapted = sum(p.numel() for n, p in model.named_parameters() if ".base_layer." in n) * 4 / 2**20
        assert second["sync/mb"] == pytest.approx(adapted) and second["sync/mb"] < first["sync/mb"]
    finally:
        engines.shutdown()


def test_adapter_sync_serves_a_new_adapter_every_time(tiny_path, tiny_model):
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, timeout_s=120, lora_sync="adapter")
    engines = rollout.create_engines(str(tiny_path), cfg, seed=0, max_lora_rank=8)
    try:
        assert rollout.check_weights(engines, tiny_model, PROBES) < 1e-4  # no adapter yet: the base model
        model = lora_model(tiny_path, seed=2)
        stats = placement.sync_weights(engines, zero0(model), 0)
        factors = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) * 4 / 2**20
        assert stats["sync/mb"] == pytest.approx(factors)
        assert rollout.check_weights(engines, model, PROBES) < 1e-4
        first = engines.engines[0].lora
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        placement.sync_weights(engines, zero0(model), 0)
        assert rollout.check_weights(engines, model, PROBES) < 1e-4  # the new adapter, not vLLM's cached old one
        now = engines.engines[0].lora
        assert now.lora_int_id == first.lora_int_id + 1 and now.lora_name != first.lora_name
        assert not os.path.exists(first.lora_path)  # the old adapter's folder is gone
        samples = engines.generate([PROBES[0][:5]], n=2, max_new_tokens=4, seed=0)
        assert len(samples[0]) == 2
    finally:
        engines.shutdown()


def test_adapter_sync_refuses_an_engine_without_lora(tiny_path):
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, timeout_s=120, lora_sync="adapter")
    engines = rollout.create_engines(str(tiny_path), cfg, seed=0)
    try:
        with pytest.raises(rollout.EngineError, match="started without LoRA"):
            placement.sync_weights(engines, zero0(lora_model(tiny_path)), 0)
    finally:
        engines.shutdown()
    assert vllm_engine.vllm_lora_rank(8) == 8 and vllm_engine.vllm_lora_rank(4) == 8
    assert vllm_engine.vllm_lora_rank(12) == 16
    with pytest.raises(ValueError, match="lora-sync merged"):
        vllm_engine.vllm_lora_rank(1024)


def _capture_actor(monkeypatch):
    from core import rl

    made = []
    make_actor = rl.make_actor

    def keep(*a, **k):
        made.append(make_actor(*a, **k))
        return made[-1]

    monkeypatch.setattr(rl, "make_actor", keep)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_grpo_with_lora_trains_adapters_only_and_the_engine_follows(mode, tmp_path, monkeypatch, one_thread):
    """3 GRPO steps of the tiny SFT model with LoRA rank 8 and a KL term (its reference: the actor, adapters off),
    `--debug` checking engine == trainer log-probs after every sync: the base weights stay bit-identical to the
    checkpoint, the adapters move, and the merged sync shrinks to the adapted linears after the first step."""
    from safetensors.torch import load_file

    from algos.grpo import Args, main
    from core import embedded

    made = _capture_actor(monkeypatch)
    args = Args()
    args.actor.model.lora_rank, args.vllm.lora_sync, args.algo.kl_coef = 8, mode, 0.01
    args.train.max_steps, args.rollout.batch_size, args.eval.every, args.eval.max_samples = 3, 16, 0, 32
    args.actor.lr, args.debug = 1e-3, True
    args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / mode)
    main(args)
    rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "sync/mb" in r]
    assert len(synced) >= 2 and all("perf/debug_check_s" in r for r in synced)  # the check ran (and passed)
    assert all(r["loss/kl"] >= 0 and r["loss/kl"] < 1 for r in rows if "loss/kl" in r)
    model = made[0].module
    base = load_file(f"{embedded.resolve_model('cleanrlhf/tiny-sft')}/model.safetensors")
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
            continue
        assert not p.requires_grad and torch.equal(p.detach(), base[weights.hf_name(name)]), name
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # trained from 0
    if mode == "merged":  # every weight first, then the adapted linears (weights and biases) only
        whole = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n) * 4 / 2**20
        adapted = sum(p.numel() for n, p in model.named_parameters() if ".base_layer." in n) * 4 / 2**20
        assert synced[0]["sync/mb"] == pytest.approx(whole)
        assert all(r["sync/mb"] == pytest.approx(adapted) for r in synced[1:])
    else:
        factors = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) * 4 / 2**20
        assert all(r["sync/mb"] == pytest.approx(factors) for r in synced)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_grpo_lora_on_two_zero3_ranks(mode, tmp_path, one_thread):
    """`--train.ranks 2 --ds.zero-stage 3` with LoRA and a KL term (the actor with adapters off, a collective forward):
    the merged weights (or the factors) are gathered a layer at a time on both ranks, rank 0 sends them to the engine
    actor, and `--debug`'s check passes after every sync. Merged: the first step is one process's (`ranks_2_vs_1`:
    the same samples, losses and gradient norm), the check every RL script's LoRA path shares."""
    import ray
    from conftest import f32_rtol, ranks_2_vs_1

    from algos.grpo import Args, main

    def lora(args, ranks):
        args.actor.model.lora_rank, args.algo.kl_coef, args.vllm.lora_sync, args.actor.lr = 8, 0.01, mode, 1e-3

    if mode == "merged":
        both = ranks_2_vs_1(Args, main, tmp_path, lora)
        (first2, first1), rows = (both[2][0], both[1][0]), both[2]
        assert len(rows) == 2 and first2["rollout/reward_mean"] == first1["rollout/reward_mean"]  # the same samples
        for key in ("loss/policy", "train/grad_norm", "loss/clipfrac"):  # 16 x 8 rows of <= 16 tokens
            assert first2[key] == pytest.approx(first1[key], rel=max(1e-4, f32_rtol(16 * 8 * 16)), abs=1e-6), key
    else:  # the 2-rank run alone
        args = Args()
        lora(args, 2)
        args.train.ranks, args.ds.zero_stage, args.train.max_steps, args.rollout.batch_size = 2, 3, 2, 16
        args.eval.every, args.debug, args.ray.num_cpus = 0, True, 4
        args.logger.quiet, args.logger.tensorboard, args.run_dir = True, False, str(tmp_path / "z3")
        try:
            main(args)
        finally:
            ray.shutdown()
        rows = [json.loads(line) for line in (tmp_path / "z3" / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "sync/mb" in r]
    assert synced and all("perf/debug_check_s" in r for r in synced)
