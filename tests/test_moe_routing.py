"""core/moe.py: recording a forward's expert selection, replaying one (the router still gets its gradient), the
mismatch measure, and the refusals, on the embedded Qwen2-MoE `cleanrlhf/tiny-moe` (2 MoE layers, top-2 of 4)."""

from __future__ import annotations

import copy

import pytest
import torch

from core import models, moe
from core.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_moe():
    return models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny-moe")).eval()


def ids(seed: int, shape=(3, 11)) -> torch.Tensor:
    return torch.randint(4, 90, shape, generator=torch.Generator().manual_seed(seed))


def token_logp(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def test_the_recorded_selection_is_what_each_router_computed(tiny_moe):
    """The table holds, per token and MoE layer, the top-k of the router's softmax over its logits, as the model's
    own `output_router_logits` shows them."""
    x = ids(0)
    with torch.no_grad(), moe.record_routing(tiny_moe) as table:
        out = tiny_moe(input_ids=x, output_router_logits=True)
    experts = table["experts"]
    assert experts.shape == (x.numel(), 2, 2) and experts.dtype == torch.long
    for layer, logits in enumerate(out.router_logits):
        want = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices
        assert torch.equal(experts[:, layer], want), layer


def test_replaying_the_recorded_selection_changes_nothing(tiny_moe):
    x = ids(1)
    with torch.no_grad(), moe.record_routing(tiny_moe) as table:
        natural = tiny_moe(input_ids=x).logits
    with torch.no_grad(), moe.replay_routing(tiny_moe, table["experts"]):
        replayed = tiny_moe(input_ids=x).logits
    assert torch.equal(natural, replayed)


def test_a_replayed_selection_is_used_and_the_router_still_gets_its_gradient(tiny_moe):
    """Each token's experts forced to (3, 0) in both layers: the forward routes there (a recorder inside the replay
    sees the forced table), its weights are the live router's probabilities of those experts, and every router
    weight gets a gradient."""
    model = copy.deepcopy(tiny_moe)
    x = ids(2)
    forced = torch.tensor([3, 0]).expand(x.numel(), 2, 2).contiguous()
    with moe.replay_routing(model, forced), moe.record_routing(model) as seen:
        token_logp(model, x).sum().backward()
    assert torch.equal(seen["experts"], forced)
    for router in moe.routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        natural = tiny_moe(input_ids=x).logits
        with moe.replay_routing(tiny_moe, forced):
            assert not torch.equal(natural, tiny_moe(input_ids=x).logits)  # the forced experts compute otherwise


def test_the_replayed_weights_are_the_routers_probabilities_of_the_given_experts():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    w = moe.replayed_weights(logits, torch.tensor([[2, 0]]), norm_topk_prob=False)
    assert torch.allclose(w, torch.stack([p[0, 2], p[0, 0]])[None])
    w = moe.replayed_weights(logits, torch.tensor([[2, 0]]), norm_topk_prob=True)
    assert torch.allclose(w, torch.stack([p[0, 2], p[0, 0]])[None] / (p[0, 2] + p[0, 0]))


def test_the_mismatch_counts_decisions_whose_expert_sets_differ():
    # 3 tokens x 2 layers: token 0 agrees in both layers (one in another order), token 1 differs in layer 1,
    # token 2 differs in both: 3 of 6 decisions
    a = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [0, 2]], [[1, 2], [1, 3]]])
    b = torch.tensor([[[1, 0], [2, 3]], [[0, 1], [0, 3]], [[0, 2], [2, 3]]])
    assert moe.routing_mismatch(a, b) == pytest.approx(0.5)
    assert moe.routing_mismatch(a, b, valid=torch.tensor([True, False, False])) == 0.0
    with pytest.raises(ValueError, match=r"routing tables of shapes \(3, 2, 2\) and \(2, 2, 2\)"):
        moe.routing_mismatch(a, b[:2])


def test_near_tied_routing_a_bf16_engine_and_an_fp32_trainer_disagree_and_replay_narrows_the_gap(tiny_moe):
    """Two of each router's four experts made near-tied (their weight rows 1e-5 apart): a bf16 copy of the model (an
    engine) and the fp32 model (the trainer) route differently on a share of the (token, layer) decisions (measured
    0.135 on 4 x 24 tokens, 2026-12-05); the fp32 forward replaying the bf16 forward's selection is closer to the bf16
    log-probs than the fp32 forward routing on its own (measured mean gaps 0.00067 and 0.00149)."""
    trainer = copy.deepcopy(tiny_moe)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe.routers(trainer):
            router.weight[1].copy_(router.weight[2] + 1e-5 * torch.randn(router.weight[2].shape, generator=g))
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    x = torch.randint(4, 90, (4, 24), generator=g)
    with torch.no_grad():
        with moe.record_routing(engine) as recorded:
            engine_logp = token_logp(engine, x)
        with moe.record_routing(trainer) as own:
            free = token_logp(trainer, x)
        with moe.replay_routing(trainer, recorded["experts"]):
            replayed = token_logp(trainer, x)
    mismatch = moe.routing_mismatch(recorded["experts"], own["experts"])
    gap_free, gap_replay = (free - engine_logp).abs().mean(), (replayed - engine_logp).abs().mean()
    assert mismatch >= 0.03, mismatch
    assert gap_replay < 0.8 * gap_free, (gap_replay, gap_free)


def test_replay_is_refused_for_a_dense_model_and_a_table_that_does_not_fit(tiny_moe):
    dense = models.load_causal_lm(ModelConfig(name_or_path="cleanrlhf/tiny"))
    with pytest.raises(ValueError, match=r"--actor.routing-replay: Qwen2ForCausalLM is a dense model"):
        moe.check_routing_replay(dense, "--actor.routing-replay")
    moe.check_routing_replay(tiny_moe, "--actor.routing-replay")
    with pytest.raises(ValueError, match=r"a table of shape \(5, 3, 2\) for 2 MoE layers"):
        with moe.replay_routing(tiny_moe, torch.zeros(5, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"layer 0 routes \(33, 2\) \(tokens, top_k\), the table holds \(5, 2\)"):
        with torch.no_grad(), moe.replay_routing(tiny_moe, torch.zeros(5, 2, 2, dtype=torch.long)):
            tiny_moe(input_ids=ids(3))


@pytest.mark.parametrize("packed", [True, False])
def test_replay_holds_after_packing(tiny_moe, packed):
    """Three sequences of 5, 9 and 7 tokens, each recorded on its own (an engine's per-sequence record): laid out by
    `table_for_forward` for the trainer's packed forward (rows of twice the longest sequence, `rl.model_inputs`), or
    its padded one, the forward routes every real token as recorded and computes each token's output as the
    sequence's own forward did."""
    from core import rl
    from core.episode import Episode

    lengths = [5, 9, 7]
    seqs = [ids(10 + i, (1, n))[0].tolist() for i, n in enumerate(lengths)]
    rows, alone = [], []
    with torch.no_grad():
        for s in seqs:
            with moe.record_routing(tiny_moe) as table:
                alone.append(tiny_moe(input_ids=torch.tensor([s])).logits[0])
            rows.append(table["experts"])
    episodes = [Episode({}, s[:2], s[2:], [0.0] * (len(s) - 2), [1] * (len(s) - 2), False) for s in seqs]
    batch = rl.sequences(episodes, 0, "cpu", packed)
    inputs, index = rl.model_inputs(tiny_moe, batch)
    table = moe.table_for_forward(rows, index, inputs["input_ids"].numel())
    with torch.no_grad(), moe.replay_routing(tiny_moe, table), moe.record_routing(tiny_moe) as seen:
        logits = tiny_moe(**inputs, use_cache=False).logits
    flat = logits.reshape(-1, logits.shape[-1])
    for b, n in enumerate(lengths):
        where = index[b, :n]
        assert torch.equal(seen["experts"][where], rows[b]), b
        torch.testing.assert_close(flat[where], alone[b], rtol=0, atol=1e-5)  # fp32 attention over other spans
    # one row short is an engine's record (its last sampled token was never forwarded): filler there; two is refused
    short = moe.table_for_forward([rows[0], rows[1][:8], rows[2]], index, inputs["input_ids"].numel())
    assert torch.equal(short[index[1, :8]], rows[1][:8])
    assert torch.equal(short[index[1, 8]], torch.arange(2).expand(2, 2))
    with pytest.raises(ValueError, match=r"row 1 has 9 tokens in the batch and 7 recorded"):
        moe.table_for_forward([rows[0], rows[1][:7], rows[2]], index, inputs["input_ids"].numel())
