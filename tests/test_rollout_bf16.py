"""core/rollout.py with a bf16 engine and a bf16 trainer on CPU: weight sync round trip and `check_weights`' bf16
tolerance. Its own module because test_rollout.py's fp32 engine lives for that whole module, and shutting down one
in-process engine tears down vLLM's process-wide state under any other."""

from __future__ import annotations

import pytest
import torch
from conftest import in_process_engines

from core import embedded, models, rollout
from core.config import ModelConfig


@pytest.fixture(scope="module")
def sft_path() -> str:
    return str(embedded.ensure_sft_warm_start())


@pytest.fixture(scope="module")
def engines(sft_path):
    yield from in_process_engines(sft_path, "bfloat16")


def test_bf16_check_passes_when_synced_and_catches_other_weights(engines, sft_path, tiny_path, tokenizer):
    """The trained warm start is where bf16 rounding differs most (peaky logits): a synced bf16 engine must pass the
    default check, and an engine holding other weights must fail it, before and after a sync in each direction."""
    prompts = [tokenizer(f"{a}+{b}=").input_ids for a, b in [(12, 34), (7, 8), (99, 1), (45, 67), (3, 96)]]
    seqs = [
        p + s.token_ids for p, g in zip(prompts, engines.generate(prompts, n=4, max_new_tokens=12, seed=1)) for s in g
    ]
    sft = models.load_causal_lm(ModelConfig(name_or_path=sft_path, dtype="bf16")).eval()
    base = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="bf16")).eval()
    assert sft.dtype == torch.bfloat16 and sft.config._attn_implementation == "eager"  # the CPU bf16 trainer

    worst = rollout.check_weights(engines, sft, seqs)
    assert 1e-3 < worst <= rollout.BF16_ATOL  # bf16 rounding shows (the fp32 tolerance would refuse it), in bounds
    with pytest.raises(rollout.EngineError, match="vllm-engine-0.*disagrees"):
        rollout.check_weights(engines, base, seqs)
    try:
        engines.update_weights(base.named_parameters())  # bf16 trainer -> bf16 engine: the sync itself
        assert rollout.check_weights(engines, base, seqs) <= rollout.BF16_ATOL
        with pytest.raises(rollout.EngineError, match="disagrees"):
            rollout.check_weights(engines, sft, seqs)
    finally:
        engines.update_weights(sft.named_parameters())
    assert rollout.check_weights(engines, sft, seqs) <= rollout.BF16_ATOL
