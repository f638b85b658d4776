"""Partial rollout in algos/grpo_async.py (`--train.partial-rollout N`): the segment loop of core/rollout.py
(`generate_segment`: continuation token in, token out, seeds, stop tokens, the length budget, version tags), the
pause inside a step in core/producer.py's `Pipeline` (which weights sample which segment, whatever the threads'
timing; a checkpoint's in-flight step), and end-to-end runs: tokens tagged across a sync with the engine's own
log-probs, lag 0 equal to grpo.py, and exact resume from a checkpoint taken while a step was paused."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from core import rollout
from core.producer import InFlight, Pipeline
from core.rollout import Sample

STOP = 0


class FakeEngines:
    """A seeded sampler with `RolloutEngines.generate`'s contract: sample j of prompt i draws from seed[i] + j, token
    k of a sample is the k-th draw of its own random stream (so a request cut at k tokens is the prefix of the uncut
    one), STOP ends a sample; log-probs say which weights version and which token they belong to. Records every
    call."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompt_token_ids, n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=None, **_):
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            group = []
            for j in range(n):
                rng = random.Random((seed[i] if isinstance(seed, list) else seed + i * n) + j)
                tokens = []
                while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != STOP):
                    tokens.append(rng.randrange(0, 6))
                reason = "stop" if tokens[-1] == STOP else "length"
                logprobs = [-(self.version + 0.01 * t + 0.001 * len(prompt)) for t in tokens]
                group.append(Sample(tokens, logprobs, reason, reason == "length"))
            out.append(group)
        self.calls.append({"prompts": [list(p) for p in prompt_token_ids], "n": n, "max_new_tokens": max_new_tokens,
                           "seed": seed, "version": self.version, "out": out})  # fmt: skip
        return out


def test_segments_continue_token_in_token_out_under_the_new_weights():
    engines, prompts, seeds, n, max_new = FakeEngines(), [[7, 8, 9], [5, 5]], [100, 108], 4, 8
    first = rollout.generate_segment(engines, prompts, n, max_new, until=3, segment=0, version=0, seed=seeds)
    whole = FakeEngines().generate(prompts, n=n, max_new_tokens=max_new, seed=seeds)
    assert engines.calls[0]["seed"] == seeds and engines.calls[0]["max_new_tokens"] == 3  # the uninterrupted request
    for g1, g2 in zip(first, whole):
        for s, full in zip(g1, g2):
            assert s.token_ids == full.token_ids[:3] and s.versions == [0] * len(s.token_ids)
    engines.version = 1  # the weight sync
    done = rollout.generate_segment(engines, prompts, n, max_new, until=max_new, segment=1, version=1, groups=first,
                                    seed=seeds)  # fmt: skip
    cont = engines.calls[1]
    pending = [(i, j) for i, g in enumerate(first) for j, s in enumerate(g) if s.finish_reason == "length"]
    stopped = [(i, j) for i, g in enumerate(first) for j, s in enumerate(g) if s.finish_reason == "stop"]
    assert pending and stopped  # both kinds occur with these seeds
    assert cont["n"] == 1 and cont["max_new_tokens"] == max_new - 3
    assert cont["prompts"] == [prompts[i] + first[i][j].token_ids for i, j in pending]  # the tokens, not text
    own = [seeds[i] + j for i, j in pending]
    assert len(set(cont["seed"])) == len(pending)  # a seed of its own per continuation ...
    assert not set(cont["seed"]) & {seeds[i] + j for i in range(2) for j in range(n)}  # ... no response's own seed
    assert cont["seed"] == [rollout.segment_seed(s, 1) for s in own] and rollout.segment_seed(own[0], 0) == own[0]
    for (i, j), (new,) in zip(pending, cont["out"]):
        s = done[i][j]
        assert s.token_ids == first[i][j].token_ids + new.token_ids and len(s.token_ids) <= max_new
        assert s.logprobs == first[i][j].logprobs + new.logprobs  # each segment's log-probs as the engine gave them
        assert s.versions == [0] * 3 + [1] * len(new.token_ids)
        assert (s.finish_reason, s.truncated) == (new.finish_reason, new.truncated)
    for i, j in stopped:  # stopped at a stop token within the first segment: left as it was
        assert done[i][j] == first[i][j] and done[i][j].token_ids[-1] == STOP
    assert rollout.generate_segment(engines, prompts, n, max_new, until=max_new, segment=2, version=2, groups=done,
                                    seed=seeds) == done and len(engines.calls) == 2  # fmt: skip  # nothing left


def drive(lag: int, first: int = 0, last: int = 8, carried: dict | None = None, partial: bool = True, seed: int = 0):
    """The training loop's side of a Pipeline whose producer pauses inside each step (partial rollout), with random
    delays on both sides. Returns the trained items (step, first segment's version, the rest's version), the
    checkpoint states (`engines_idle_for`) and whether any generation overlapped a sync."""
    rng, syncing, producing, clash = random.Random(seed), threading.Event(), threading.Event(), []

    def generate() -> None:
        producing.set()
        clash.append(syncing.is_set())
        time.sleep(rng.random() * 0.003)
        clash.append(syncing.is_set())
        producing.clear()

    def produce(step: int, version: int):
        in_flight = pipe.resumed(step)
        if in_flight is None:
            generate()  # the first segment
            v0 = version
            if partial and lag >= 1 and step - lag >= first:
                version = pipe.pause(step, InFlight([[("segment 0", step, v0)]]))
        else:
            v0 = in_flight.groups[0][0][2]
        generate()  # the rest
        return ("rollout", step, v0, version)

    pipe = Pipeline(produce, first, last, lag, carried or {})
    pipe.thread.start()
    trained, ahead = [], {}
    try:
        for step in range(first, last):
            trained.append(pipe.take(step))
            time.sleep(rng.random() * 0.003)  # training
            ahead[step] = pipe.engines_idle_for(step)
            syncing.set()
            clash.append(producing.is_set())
            time.sleep(rng.random() * 0.002)  # the weight sync: the engines must be idle
            syncing.clear()
            pipe.synced_update(step)
    finally:
        pipe.stop()
    return trained, ahead, any(clash)


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_each_segment_is_sampled_by_the_weights_the_lag_rule_gives(lag):
    """Step t's first segment by the weights of update t − lag, the rest by those of update t − lag + 1 (lag ≥ 1, from
    step lag on; lag 0 has no sync inside a step), under any thread interleaving; no generation overlaps a sync; the
    checkpoint of step t holds steps t + 1 .. t + lag, the last of them paused in flight."""
    for seed in range(5):
        trained, ahead, clash = drive(lag, seed=seed)
        assert [s for _, s, _, _ in trained] == list(range(8)) and not clash
        assert [v0 for *_, v0, _ in trained] == [max(0, t - lag) for t in range(8)]
        assert [v for *_, v in trained] == [t - lag + 1 if lag and t >= lag else max(0, t - lag) for t in range(8)]
        for t in range(7):
            want = list(range(t + 1, min(t + lag, 7) + 1))
            assert sorted(ahead[t]) == want
            if lag and t + lag < 8:
                assert isinstance(ahead[t][t + lag], InFlight)
                assert all(not isinstance(ahead[t][s], InFlight) for s in want[:-1])


def test_a_step_paused_in_a_checkpoint_resumes_under_the_checkpoints_weights():
    """A checkpoint after step 4 (lag 2) holds step 5 whole and step 6 paused after its first segment (sampled by the
    weights of update 4); the resumed run continues step 6 under the checkpoint's weights (update 5) and then goes on
    exactly as the uninterrupted run."""
    straight, ahead, _ = drive(lag=2)
    carried = ahead[4]
    assert isinstance(carried[6], InFlight) and carried[6].groups[0][0] == ("segment 0", 6, 4)
    resumed, _, clash = drive(lag=2, first=5, carried=carried)
    assert resumed == straight[5:] and not clash
    assert resumed[1] == ("rollout", 6, 4, 5)


def test_stopping_while_paused_ends_the_producer_quietly():
    paused = threading.Event()

    def produce(step: int, version: int):
        paused.set()
        pipe.pause(step, InFlight([]))
        raise AssertionError("the pause returned after stop")

    pipe = Pipeline(produce, 0, 4, 0, {})  # step 0 starts at once; its pause waits for update 1, which never comes
    pipe.thread.start()
    assert paused.wait(10)
    pipe.stop()
    assert not pipe.thread.is_alive() and pipe.error is None


def _small_args(run_dir, steps: int, lag: int, cut: int | None):
    from algos.grpo_async import Args

    args = Args()
    args.train.max_steps, args.rollout.batch_size, args.train.micro_batch_size = steps, 16, 64
    args.train.max_lag, args.train.partial_rollout = lag, cut
    args.eval.every, args.eval.max_samples = 0, 64
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(run_dir)
    return args


def _rows(run_dir) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


@pytest.mark.slow
def test_tokens_are_tagged_with_the_weights_that_sampled_them_across_a_sync(tmp_path, monkeypatch, one_thread):
    """Lag 1, first segment 2 tokens, 3 steps, `--debug` (engine == trainer log-probs after every sync): step 0 is
    sampled whole by the initial weights; in steps 1 and 2 each response's first 2 tokens come from the weights of
    update t − 1 and the rest from those of update t, continued by the engine from prompt + those tokens. The trained
    table's behaviour log-probs are, segment by segment, exactly what the engine returned."""
    from algos import grpo_async
    from core import rollout as core_rollout

    calls, tables = [], []
    generate, update = core_rollout.RolloutEngines.generate, grpo_async.update

    def record_generate(self, prompt_token_ids, **kw):
        out = generate(self, prompt_token_ids, **kw)
        if kw.get("temperature", 1.0) > 0:  # not the greedy eval
            calls.append(([list(p) for p in prompt_token_ids], kw, out))
        return out

    def record_update(actor, ref, seqs, adv, args, run, step, kl_coef, **kw):
        tables.append((step, {k: v.clone() for k, v in seqs.items() if k in ("input_ids", "loss_mask", "rollout_logp",
                                                                             "versions")}))  # fmt: skip
        return update(actor, ref, seqs, adv, args, run, step, kl_coef, **kw)

    monkeypatch.setattr(core_rollout.RolloutEngines, "generate", record_generate)
    monkeypatch.setattr(grpo_async, "update", record_update)
    args = _small_args(tmp_path / "run", steps=3, lag=1, cut=2)
    args.debug = True
    grpo_async.main(args)

    # every sampled (prompt, response) -> its log-probs, per generate call: segment 0 calls and continuations
    sampled = {}
    for prompts, kw, out in calls:
        for p, group in zip(prompts, out):
            for s in group:
                sampled.setdefault((tuple(p), tuple(s.token_ids)), []).append((kw["max_new_tokens"], s.logprobs))
    spans = 0
    for step, t in tables:
        for row in range(len(t["input_ids"])):
            resp = t["loss_mask"][row].nonzero().flatten()
            ids, versions = t["input_ids"][row], t["versions"][row, resp].tolist()
            logp = t["rollout_logp"][row, resp].tolist()
            prompt, tokens = ids[: resp[0]].tolist(), ids[resp].tolist()
            assert versions == sorted(versions)  # non-decreasing within a row
            if step == 0:
                assert set(versions) == {0}
            else:  # the lag rule: the first 2 tokens by the weights of update t − 1, the rest by those of update t
                assert versions == [step - 1] * min(2, len(tokens)) + [step] * (len(tokens) - 2)
            spans += len(set(versions)) > 1
            cut = 2 if len(set(versions)) > 1 else len(tokens)
            first = sampled[(tuple(prompt), tuple(tokens[:cut]))]  # the first segment as the engine returned it
            assert any(lp == pytest.approx(logp[:cut], abs=1e-6) for _, lp in first)
            if cut < len(tokens):  # the continuation: a request of its own, prompt + the first segment's tokens
                rest = sampled[(tuple(prompt + tokens[:cut]), tuple(tokens[cut:]))]
                assert any(lp == pytest.approx(logp[cut:], abs=1e-6) for _, lp in rest)
    assert spans > 10  # many responses hold tokens of two policy versions
    rows = _rows(tmp_path / "run")
    assert [rows[s]["rollout/lag"] for s in (1, 2, 3)] == [0, 1, 1]
    assert rows[1]["rollout/versions_per_sample"] == 1 and rows[1]["rollout/stale_token_frac"] == 0
    for s in (2, 3):
        assert 1 < rows[s]["rollout/versions_per_sample"] <= 2 and 0 < rows[s]["rollout/stale_token_frac"] < 1


@pytest.mark.slow
def test_halt_while_a_step_is_paused_and_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch, one_thread):
    """Lag 1, first segment 2 tokens: 4 steps straight vs 2 steps, halt, resume. The checkpoint of step 2 is taken
    while step 3 waits at its sync with its first segment generated (by the weights of update 1, which the resumed
    run no longer has): it carries that segment, and the resumed run continues it under update 2's weights, so steps
    3 and 4 equal the uninterrupted run's."""
    from algos import grpo_async
    from core import producer

    carried = []
    init = producer.Pipeline.__init__

    def record(self, produce, first, last, lag, carried_steps, world=1):
        carried.append({t: type(r).__name__ for t, r in carried_steps.items()})
        init(self, produce, first, last, lag, carried_steps, world)

    monkeypatch.setattr(producer.Pipeline, "__init__", record)
    straight, part = (_small_args(tmp_path / name, steps=4, lag=1, cut=2) for name in ("straight", "part"))
    straight.eval.every = part.eval.every = 2
    grpo_async.main(straight)
    part.train.halt_after = 2
    assert grpo_async.main(part)["halted"]
    part.train.halt_after = None
    grpo_async.main(part)
    assert carried == [{}, {}, {2: "InFlight"}]  # step 3 (index 2) paused inside, carried by the checkpoint
    expected, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "part")
    assert expected[4]["rollout/versions_per_sample"] > 1
    for step in (3, 4):
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/versions_per_sample",
                    "rollout/stale_token_frac", "loss/policy", "loss/is_weight", "eval/pass@1"):  # fmt: skip
            if key in expected[step]:
                assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
