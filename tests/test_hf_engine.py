"""`--vllm.engine hf` (core.hf_engine.HFEngine): one transformers `generate` call for a whole batch of prompts, each
prompt's samples drawn from its own seeded generator (`RowSampler`), with the log-probs of the distribution sampled
from. The picture path is tests/test_vlm.py's; a GRPO run through this engine is tests/test_bench_grpo.py's."""

from __future__ import annotations

import pytest
import torch

from core import hf_engine, models, rollout

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TEXTS = ["1+2=", "13+45=", "7+70=", "99+1=", "5+55="]


@pytest.fixture(scope="module")
def hf(tiny_path, tokenizer):
    engine = hf_engine.HFEngine(str(tiny_path), rollout.VLLMConfig(engine="hf"), seed=3)
    calls = []
    generate = engine.model.generate
    engine.model.generate = lambda *a, **k: calls.append(k["input_ids"].shape) or generate(*a, **k)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in prompts}) > 1  # prompts of several lengths: the batch is left-padded
    return engine, calls, prompts


def trainer_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log-softmax(logits / T) of `tokens` after `prompt`, from one unpadded forward: what the engine should report."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_one_generate_call_for_the_batch_with_the_sampled_distributions_log_probs(hf):
    engine, calls, prompts = hf
    calls.clear()
    groups = engine.generate(prompts, n=3, max_new_tokens=6, temperature=0.7, seed=11, ignore_eos=True)
    assert calls == [torch.Size([len(prompts) * 3, max(len(p) for p in prompts)])]  # one call, P·n rows
    assert [len(g) for g in groups] == [3] * len(prompts)
    for p, g in zip(prompts, groups):
        for s in g:
            assert len(s.token_ids) == 6 and s.finish_reason == "length"
            want = trainer_logprobs(engine.model, p, s.token_ids, temperature=0.7)
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4), (s.logprobs, want)
    # the n samples of a prompt are not copies of one another (the random tiny model at T 0.7 over 6 tokens)
    assert all(len({tuple(s.token_ids) for s in g}) > 1 for g in groups)


def test_a_prompts_samples_do_not_depend_on_the_other_prompts_of_the_call(hf):
    engine, _, prompts = hf
    together = engine.generate(prompts, n=2, max_new_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    again = engine.generate(prompts, n=2, max_new_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    assert [[s.token_ids for s in g] for g in together] == [[s.token_ids for s in g] for g in again]  # seeded
    for i in (1, 3):  # alone (no padding, no neighbours), under the seed the batch gave it: seed + i · n
        alone = engine.generate([prompts[i]], n=2, max_new_tokens=5, temperature=1.0, seed=5 + i * 2, ignore_eos=True)
        assert [s.token_ids for s in alone[0]] == [s.token_ids for s in together[i]]
        for a, b in zip(alone[0], together[i]):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    listed = engine.generate(prompts[:2], n=2, max_new_tokens=5, temperature=1.0, seed=[5, 7], ignore_eos=True)
    assert [s.token_ids for s in listed[1]] == [s.token_ids for s in together[1]]  # a list of seeds, one per prompt


def test_greedy_equals_the_greedy_reference_and_top_p_keeps_the_nucleus(hf, tokenizer):
    engine, _, prompts = hf
    greedy = engine.generate(prompts, n=1, max_new_tokens=6, temperature=0.0)
    want = models.greedy_generate(engine.model, tokenizer, prompts, 6)
    got = [g[0].token_ids[:-1] if g[0].finish_reason == "stop" else g[0].token_ids for g in greedy]  # stop token cut
    assert got == want
    for p, g in zip(prompts, greedy):
        assert torch.allclose(torch.tensor(g[0].logprobs), trainer_logprobs(engine.model, p, g[0].token_ids), atol=1e-4)
    # top-p 0.5: every sampled token is inside the smallest set of most likely tokens holding half the probability,
    # and its log-prob is renormalised over that set (>= the plain one)
    nucleus = engine.generate(prompts, n=4, max_new_tokens=4, temperature=1.0, top_p=0.5, seed=2, ignore_eos=True,
                              top_logprobs=3)  # fmt: skip
    for p, g in zip(prompts, nucleus):
        for s in g:
            plain = trainer_logprobs(engine.model, p, s.token_ids)
            assert (torch.tensor(s.logprobs) >= plain - 1e-5).all()
            ids = torch.tensor([p + s.token_ids])
            with torch.no_grad():
                probs = torch.softmax(engine.model(input_ids=ids).logits[0, len(p) - 1 : -1].float(), -1)
            for t, (tok, pr) in enumerate(zip(s.token_ids, probs)):
                above = pr[pr > pr[tok]].sum().item()  # the mass of the strictly more likely tokens
                assert above < 0.5 + 1e-5, (t, above)
            assert len(s.top_logprobs) == 4 and all(len(d) == 3 for d in s.top_logprobs)
            assert all(abs(d[tok] - lp) < 1e-6 for d, tok, lp in zip(s.top_logprobs, s.token_ids, s.logprobs) if tok in d)


def test_on_tokens_reports_every_step_of_every_sample_until_it_stops(hf):
    """`on_tokens(i, j, ids so far)` (the agent server's live stream): called once per new token of sample j of prompt
    i, growing by one each time, never after its stop token; its last report is the returned sample."""
    engine, _, prompts = hf
    heard = {}

    def on_tokens(i, j, ids):
        before = heard.setdefault((i, j), [])
        assert ids[:-1] == (before[-1] if before else []) and len(ids) == len(before) + 1
        before.append(list(ids))

    groups = engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=4, on_tokens=on_tokens)
    plain = engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=4)
    assert [[s.token_ids for s in g] for g in groups] == [[s.token_ids for s in g] for g in plain]  # same samples
    for i, g in enumerate(groups):
        for j, s in enumerate(g):
            assert heard[(i, j)][-1] == s.token_ids
    assert any(s.finish_reason == "stop" for g in groups for s in g)  # some sample stopped early (and was not heard after)
