"""Tests for core/packing.py: the padding-free packed forward gives the same log-probs, SFT loss and gradients as the
right-padded forward on the tiny model (fp32, tight tolerance), bf16 packing against fp32, and pack/collate/unpack
bookkeeping."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from algos.sft import sft_loss
from core import models, packing
from core.config import ModelConfig


def random_examples(seed: int, n: int = 6, min_len: int = 2, max_len: int = 40, vocab: int = 100) -> list[dict]:
    """Variable-length samples: random ids, a prompt part (mask 0, at least one token) then targets (mask 1)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompt = rng.randint(1, length - 1)
        out.append(
            {
                "input_ids": [rng.randrange(4, vocab) for _ in range(length)],
                "loss_mask": [0] * prompt + [1] * (length - prompt),
            }
        )
    return out


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_path):
    return AutoModelForCausalLM.from_pretrained(
        tiny_path, dtype=torch.float32, attn_implementation=request.param
    ).eval()


def per_sample_logprobs(model, examples, pad_id, temperature=1.0, row_len=None):
    packed = packing.collate_packed(examples, row_len=row_len)
    padded = packing.collate_padded(examples, pad_id)
    with torch.no_grad():
        lp_packed = packing.unpack(packing.token_logprobs(model, packed, temperature), packed["segments"])
        lp_padded = packing.token_logprobs(model, padded, temperature)
    return lp_packed, [lp_padded[i, : len(ex["input_ids"])] for i, ex in enumerate(examples)], padded


@pytest.mark.parametrize("row_len", [None, 45, 80])  # one row; several rows, each closed by a pad segment
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_packed_logprobs_equal_padded(model, tokenizer, seed, row_len):
    examples = random_examples(seed)
    lp_packed, lp_padded, _ = per_sample_logprobs(model, examples, tokenizer.pad_token_id, row_len=row_len)
    for ex, a, b in zip(examples, lp_packed, lp_padded):
        assert a.shape == (len(ex["input_ids"]),) and a[0] == 0 and b[0] == 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        mask = torch.tensor(ex["loss_mask"], dtype=torch.bool)
        assert (a[mask] < 0).all()  # real log-probs at every target (a cross-sample leak would be caught above)


@pytest.mark.parametrize("row_len", [None, 45])  # one row (the layout flex_attention gets); two rows with a pad segment
def test_flex_attention_packed_logprobs_equal_padded(tiny_path, tokenizer, row_len):
    """FlexAttention's block mask, which transformers builds from the restarting position ids (no dense (L, L) mask;
    blocks across samples skipped), keeps packed samples apart: its packed log-probs equal the padded sdpa forward's.
    Forward only: torch has no FlexAttention backward on CPU (tests/test_gpu.py trains through it on CUDA)."""
    flex = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="flex_attention")
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="sdpa")
    examples = random_examples(5)
    packed = packing.collate_packed(examples, row_len=row_len)
    padded = packing.collate_padded(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        lp_packed = packing.unpack(packing.token_logprobs(flex.eval(), packed), packed["segments"])
        lp_padded = packing.token_logprobs(sdpa.eval(), padded)
    for ex, a, b in zip(examples, lp_packed, lp_padded):
        torch.testing.assert_close(a, b[: len(ex["input_ids"])], rtol=0, atol=1e-5)  # fp32 sums over ≤ 240 terms


def test_flex_attention_on_cpu_is_refused_with_the_flag_named(tiny_path):
    """`--model.attn-implementation flex_attention` without CUDA would fail in the first backward, deep in torch: the
    loader refuses it up front, naming the flag and what to use instead. Packing decisions treat it as one-row."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: flex_attention is allowed")
    with pytest.raises(ValueError, match=r"--model.attn-implementation flex_attention: .*no backward pass on CPU"):
        models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), attn_implementation="flex_attention"))
    assert models.packs_in_one_row("flex_attention") and models.packs_in_one_row("flash_attention_2")
    assert not models.packs_in_one_row("sdpa") and not models.packs_in_one_row("eager")


def test_padded_logprobs_are_the_reference_log_softmax(model, tokenizer):
    """The padded path itself is right: it equals log_softmax of each sample run alone, at temperature T too."""
    examples = random_examples(7, n=3)
    lp_packed, lp_padded, _ = per_sample_logprobs(model, examples, tokenizer.pad_token_id, temperature=0.7)
    for ex, a, b in zip(examples, lp_packed, lp_padded):
        ids = torch.tensor([ex["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / 0.7
        ref = F.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(b[1:], ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(a[1:], ref, rtol=0, atol=1e-5)


def test_bf16_eager_packed_logprobs_match_fp32(tiny_path):
    """bf16 with eager attention (the CPU default for bf16) on a packed batch gives the fp32 log-probs, to bf16
    precision: the mask built in bf16 still keeps every sample to itself."""
    examples = random_examples(5)
    batch = packing.collate_packed(examples, row_len=60)
    out = {}
    for dtype in ("fp32", "bf16"):
        lm = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype=dtype, attn_implementation="eager"))
        with torch.no_grad():
            out[dtype] = packing.token_logprobs(lm.eval(), batch).float()
    mask = batch["loss_mask"]
    assert out["fp32"][mask].mean() < -1.0  # real log-probs of a random-init model, not zeros
    # measured: 0.005 apart at most; a mask that let samples see each other moves them by 0.8
    torch.testing.assert_close(out["bf16"][mask], out["fp32"][mask], rtol=0, atol=0.05)


def test_packing_changes_nothing_but_the_layout(model, tokenizer):
    """A negative control: without restarting position ids the packed forward would leak across samples."""
    examples = random_examples(4)
    packed = packing.collate_packed(examples)
    leaky = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
    with torch.no_grad():
        good = packing.token_logprobs(model, packed)
        bad = packing.token_logprobs(model, leaky)
    n0 = packed["seq_lens"][0]
    assert (good[0, n0 + 1 :] - bad[0, n0 + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("row_len", [None, 50])
@pytest.mark.parametrize("seed", [0, 1])
def test_sft_loss_and_gradients_packed_equal_padded(tiny_path, tokenizer, seed, row_len):
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    base.train()
    examples = random_examples(10 + seed, n=8)
    num_tokens = sum(sum(ex["loss_mask"]) for ex in examples)

    def loss_and_grads(model, batches):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:  # gradient accumulation over micro-batches, as algos/sft.py does
            loss = sft_loss(packing.token_logprobs(model, batch), batch["loss_mask"], num_tokens)
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_model, packed_model = copy.deepcopy(base), copy.deepcopy(base)
    loss_padded, grads_padded = loss_and_grads(padded_model, [packing.collate_padded(examples, tokenizer.pad_token_id)])
    groups = packing.pack(examples, max_tokens=80)
    assert 1 < len(groups) < len(examples)  # several micro-batches, several samples in some of them
    loss_packed, grads_packed = loss_and_grads(
        packed_model, [packing.collate_packed(g, row_len=row_len) for g in groups]
    )

    # the reference value: the token mean of -log p over targets
    lp = torch.cat([b[torch.tensor(ex["loss_mask"], dtype=torch.bool)] for ex, b in
                    zip(examples, per_sample_logprobs(base.eval(), examples, tokenizer.pad_token_id)[1])])  # fmt: skip
    assert loss_padded == pytest.approx(-lp.mean().item(), rel=1e-5)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5)
    assert grads_padded.keys() == grads_packed.keys()
    for name, g in grads_padded.items():
        assert g.abs().sum() > 0, name  # every parameter gets a gradient, so the comparison means something
        torch.testing.assert_close(grads_packed[name], g, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------- prefix sharing
def prefix_groups(seed: int) -> list[list[dict]]:
    """Groups as DPO (and best-of-n) batches have them: a shared prompt, then 2-3 responses that may share their
    first tokens or end up a prefix of each other; plus a lone sequence and a group with nothing in common."""
    rng = random.Random(seed)
    groups = []
    for _ in range(5):
        prompt = [rng.randrange(4, 100) for _ in range(rng.randint(1, 12))]
        stem = [rng.randrange(4, 100) for _ in range(rng.randint(0, 2))]  # response tokens all members share
        members = []
        for _ in range(rng.randint(2, 3)):
            ids = prompt + stem + [rng.randrange(4, 100) for _ in range(rng.randint(1, 8))]
            members.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))})
        groups.append(members)
    groups[1].append({"input_ids": groups[1][0]["input_ids"][:-1], "loss_mask": groups[1][0]["loss_mask"][:-1]})
    groups.append(random_examples(seed, n=1))
    groups.append(random_examples(seed + 100, n=2))
    return groups


@pytest.mark.parametrize("row_len", [None, 30, 200])  # a row per group; several groups a row, pad segments
@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_shared_sums_and_gradients_equal_padded(model, tokenizer, seed, row_len):
    """Each sequence's summed masked log-prob, and the gradient of a weighted sum of them, from one prefix-shared
    forward equal those of the right-padded forward of the sequences one by one."""
    groups = prefix_groups(seed)
    flat = [ex for g in groups for ex in g]
    batch = packing.collate_prefix_shared(groups, row_len=row_len)
    weights = torch.linspace(-1, 2, len(flat))

    def sums_and_grads(forward):
        model.zero_grad(set_to_none=True)
        sums = forward()
        (sums * weights).sum().backward()
        return sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def padded():
        return torch.stack([(packing.token_logprobs(model, b) * b["loss_mask"]).sum()
                            for b in (packing.collate_padded([ex], tokenizer.pad_token_id) for ex in flat)])  # fmt: skip

    want, grads_want = sums_and_grads(padded)
    got, grads_got = sums_and_grads(lambda: packing.prefix_shared_logp_sums(model, batch))
    # a sum of ~100 nats in float32 is exact to ~1e-5 at best: an AMX Xeon's sdpa kernels landed 2.3e-5 apart
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-5)
    for name, g in grads_want.items():
        assert g.abs().sum() > 0, name
        # atol relative to the tensor's scale: the tied embedding's rows sum many tokens' terms in another order
        torch.testing.assert_close(grads_got[name], g, rtol=1e-4, atol=1e-6 + 2e-6 * g.abs().max().item(), msg=name)


def test_prefix_shared_layout_stores_the_common_prefix_once():
    a = {"input_ids": [1, 5, 6, 7, 8, 2], "loss_mask": [0, 0, 0, 1, 1, 1]}
    b = {"input_ids": [1, 5, 6, 7, 9, 9, 2], "loss_mask": [0, 0, 0, 1, 1, 1, 1]}
    batch = packing.collate_prefix_shared([[a, b]])
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 8, 2, 9, 9, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4, 5, 6]]
    allowed = batch["allowed"][0]
    assert allowed[6, :4].all() and not allowed[6, 4:6].any() and allowed[6, 6]  # b's branch: prefix + itself
    assert batch["num_seqs"] == 2 and batch["weight"].sum() == 3 + 4


def _collate_prefix_shared_reference(groups: list[list[dict]], device="cpu", row_len: int | None = None) -> dict:
    """A frozen copy of the original slice-by-slice implementation, the reference for the faster one."""
    layouts, sizes = [], []
    for group in groups:
        ids = [ex["input_ids"] for ex in group]
        s = 0  # the longest common prefix (a lone sequence is all prefix; 0: nothing shared, still correct)
        while all(len(x) > s for x in ids) and all(x[s] == ids[0][s] for x in ids):
            s += 1
        layouts.append(s)
        sizes.append(s + sum(len(x) - s for x in ids))
    rows = [[g] for g in range(len(groups))] if row_len is None else packing.first_fit_rows(sizes, row_len)
    width = max(sum(sizes[g] for g in row) for row in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    group_of = torch.full((len(rows), width), -1, dtype=torch.long)
    branch_of = torch.zeros((len(rows), width), dtype=torch.long)
    where: dict[int, tuple[int, int, list[int]]] = {}  # group -> (row, prefix start, branch starts)
    for r, row in enumerate(rows):
        start = 0
        for g in row:
            s, ids = layouts[g], [ex["input_ids"] for ex in groups[g]]
            input_ids[r, start : start + s] = torch.tensor(ids[0][:s], dtype=torch.long)
            position_ids[r, start : start + s] = torch.arange(s)
            group_of[r, start : start + sizes[g]] = g
            q, starts = start + s, []
            for k, x in enumerate(ids):
                n = len(x) - s
                input_ids[r, q : q + n] = torch.tensor(x[s:], dtype=torch.long)
                position_ids[r, q : q + n] = torch.arange(s, s + n)
                branch_of[r, q : q + n] = k + 1
                starts.append(q)
                q += n
            where[g] = (r, start, starts)
            start = q
        pad = width - start  # the pad tail: each position attends only to itself
        group_of[r, start:] = -2 - torch.arange(pad)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_group = group_of[:, :, None] == group_of[:, None, :]
    visible_branch = (branch_of[:, None, :] == 0) | (branch_of[:, :, None] == branch_of[:, None, :])
    allowed = causal & same_group & visible_branch  # (R, L, L): query, key
    gather: dict[str, list] = {k: [] for k in ("rows", "logit_pos", "targets", "owner", "weight", "last")}
    owner = 0
    for g, group in enumerate(groups):
        r, a, starts = where[g]
        s = layouts[g]
        for k, ex in enumerate(group):
            pos = [a + i if i < s else starts[k] + i - s for i in range(len(ex["input_ids"]))]
            n = len(pos) - 1
            gather["rows"] += [r] * n
            gather["logit_pos"] += pos[:-1]  # token j is predicted from token j - 1's logits
            gather["targets"] += ex["input_ids"][1:]
            gather["owner"] += [owner] * n
            gather["weight"] += [float(m) for m in ex["loss_mask"][1:]]
            gather["last"].append((r, pos[-1]))
            owner += 1
    out = {"input_ids": input_ids, "position_ids": position_ids, "allowed": allowed}
    out.update({k: torch.tensor(v, dtype=torch.float32 if k == "weight" else torch.long) for k, v in gather.items()})
    out["num_seqs"] = owner
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def random_prefix_groups(rng: random.Random, n_groups: int) -> list[list[dict]]:
    """1-3 sequences per group (sometimes one more, a prefix of another) sharing 0-12 tokens, random loss masks."""
    groups = []
    for _ in range(n_groups):
        prefix = [rng.randrange(4, 100) for _ in range(rng.randint(0, 12))]
        members = []
        for _ in range(rng.randint(1, 3)):
            ids = prefix + [rng.randrange(4, 100) for _ in range(rng.randint(1 if prefix else 2, 8))]
            mask = [0] + [rng.choice([0, 1, True, False]) for _ in ids[1:]]
            members.append({"input_ids": ids, "loss_mask": mask})
        if rng.random() < 0.3:  # a member that is a prefix of (or equal to) another: an empty or short branch
            ex = rng.choice(members)
            cut = rng.randint(1, len(ex["input_ids"]))
            members.append({k: v[:cut] for k, v in ex.items()})
        groups.append(members)
    return groups


@pytest.mark.parametrize("seed", range(40))
def test_prefix_shared_layout_equals_the_reference(seed):
    """The faster collate builds exactly what the original slice-by-slice one did: keys, dtypes, values."""
    rng = random.Random(seed)
    groups = random_prefix_groups(rng, rng.randint(1, 10))
    if seed % 4 == 0:
        groups.append([copy.deepcopy(groups[0][0])])  # a lone sequence: all prefix
    longest = max(len(ex["input_ids"]) for g in groups for ex in g)
    for row_len in [None, 1, longest, 2 * longest, 10 * longest]:
        want = _collate_prefix_shared_reference(groups, row_len=row_len)
        got = packing.collate_prefix_shared(groups, row_len=row_len)
        assert got.keys() == want.keys() and list(got) == list(want)
        assert got["num_seqs"] == want["num_seqs"]
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and got[k].device == v.device, k
                assert torch.equal(got[k], v), k


# ------------------------------------------------------------------------------------------------------ bookkeeping
def test_pack_respects_budget_and_order():
    examples = random_examples(0, n=50, max_len=30)
    for max_tokens in [30, 64, 100, 1000]:
        groups = packing.pack(examples, max_tokens)
        assert [ex for g in groups for ex in g] == examples  # same objects, same order, none dropped
        sizes = [sum(len(ex["input_ids"]) for ex in g) for g in groups]
        assert all(s <= max_tokens for s in sizes)
        for g, nxt in zip(groups, groups[1:]):  # greedy: a group is closed only when the next sample does not fit
            assert sum(len(ex["input_ids"]) for ex in g) + len(nxt[0]["input_ids"]) > max_tokens
    assert packing.pack([], 10) == []


def test_pack_gives_a_long_sample_its_own_group():
    lens = [3, 4, 25, 2, 2, 30, 5]
    examples = [{"input_ids": [5] * n, "loss_mask": [0] + [1] * (n - 1)} for n in lens]
    groups = packing.pack(examples, max_tokens=10)
    assert [[len(ex["input_ids"]) for ex in g] for g in groups] == [[3, 4], [25], [2, 2], [30], [5]]


def test_collate_and_unpack_round_trip():
    examples = random_examples(3, n=5)
    batch = packing.collate_packed(examples)
    n = sum(len(ex["input_ids"]) for ex in examples)
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["loss_mask"].shape == (1, n)
    assert batch["seq_lens"] == [len(ex["input_ids"]) for ex in examples]
    for key in ["input_ids", "loss_mask"]:
        assert [t.tolist() for t in packing.unpack(batch[key], batch["seq_lens"])] == [
            [int(v) for v in ex[key]] for ex in examples
        ]
    assert [t.tolist() for t in packing.unpack(batch["position_ids"], batch["seq_lens"])] == [
        list(range(len(ex["input_ids"]))) for ex in examples
    ]
    padded = packing.collate_padded(examples, pad_id=0)
    assert padded["attention_mask"].sum().item() == n and padded["loss_mask"].sum() == batch["loss_mask"].sum()
    with pytest.raises(AssertionError, match="first token"):
        packing.collate_packed([{"input_ids": [1, 2], "loss_mask": [1, 1]}])


def test_rows_layout_round_trip_and_pad_segment():
    examples = random_examples(5, n=9, max_len=30)
    batch = packing.collate_packed(examples, row_len=40)
    rows, width = batch["input_ids"].shape
    assert rows > 1 and width <= max(40, *batch["seq_lens"])
    assert rows <= len(packing.pack(examples, max(40, *batch["seq_lens"])))  # first-fit-decreasing beats in-order
    for key in ["input_ids", "loss_mask"]:
        assert [t.tolist() for t in packing.unpack(batch[key], batch["segments"])] == [
            [int(v) for v in ex[key]] for ex in examples
        ]
    assert batch["loss_mask"].sum() == sum(sum(ex["loss_mask"]) for ex in examples)  # pad segments carry no targets
    for r in range(rows):  # every row: real samples then one pad segment, each with positions from 0
        used = sum(n for row, _, n in batch["segments"] if row == r)
        assert batch["position_ids"][r, used:].tolist() == list(range(width - used))
