"""DeepSpeed AutoEP training (`--ds.expert-parallel-size N`) on CPU (gloo, fp32) with `cleanrlhf/tiny-moe` (2 layers of
4 routed experts and a shared expert): each of 2 ranks holds 2 experts per layer, and sft.py, dpo.py and the GRPO
actor train what the same 2 ranks train with every expert on each (EP=1, plain data parallelism over the same data
split), halted and resumed from a checkpoint, export whole experts under the HF names, and sync whole experts to the
rollout engine (`--debug`); and the refusals of what is not built, each naming both flags.

Tolerances: EP=2 and EP=1 add the same float32 terms in other orders (a rank's experts compute a batch of tokens
gathered from both ranks, the gradients of the experts are summed over the ranks' tokens by the all-to-all's backward
instead of the data-parallel all-reduce): `conftest.f32_rtol` of the step's token count, growing by one term per
update. The weights after Adam steps are compared in norm against the update itself (test_autotp's reason: Adam
divides each element's step by the root of its squared-gradient average, so an element whose gradient is at rounding
level may step anywhere in ±lr): ‖w_EP2 − w_EP1‖ ≤ 2 · 2n·u·(1 + updates) · ‖w_EP1 − w_0‖ for the n tokens of all steps,
the factor 2 because Adam's step m/√v carries a gradient's relative error twice (once in m, twice halved in √v)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env, f32_rtol

from core import embedded, models
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig, check_args
from core.engine import free_port

REPO = Path(__file__).resolve().parent.parent
MOE = "cleanrlhf/tiny-moe"
STEPS = 3


def run_script(script: str, tmp: Path, name: str, nproc: int, *extra: str) -> Path:
    """algos/<script>.py for STEPS steps on the tiny MoE model (eval at the start and the end), in one process (`nproc`
    0) or under torchrun with `nproc` ranks; its run folder."""
    run_dir = tmp / name
    launcher = [sys.executable] if nproc == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port())]  # fmt: skip
    cmd = [*launcher, str(REPO / "algos" / f"{script}.py"), "--model.name-or-path", MOE, "--train.max-steps",
           str(STEPS), "--train.batch-size", "16", "--train.warmup-steps", "0", "--eval.every", str(STEPS),
           "--eval.max-samples", "32", "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir),
           *extra]  # fmt: skip
    out = subprocess.run(cmd, env={**child_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def rows(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in open(run_dir / "metrics.jsonl"):
        r = json.loads(line)
        out.setdefault(r["step"], {}).update(r)
    return out


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    model = models.load_causal_lm(ModelConfig(name_or_path=str(path)))  # an HF folder as transformers loads it
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_same_run(one: Path, ep: Path, loss_keys: tuple[str, ...]) -> dict[str, float]:
    """Every step's losses and gradient norm, the evals, and the exported weights (whole experts: the HF names and
    shapes of the base model) of the EP run equal the EP=1 run's within float32 reordering. Returns the largest
    measured gaps."""
    a, b = rows(one), rows(ep)
    assert sorted(a) == sorted(b) == list(range(STEPS + 1))
    gaps = {"rel": 0.0, "weights": 0.0}
    for step in range(STEPS + 1):
        keys = [k for k in a[step] if k in (*loss_keys, "train/grad_norm") or k.startswith("eval/")]
        assert keys and sorted(keys) == sorted(k for k in b[step] if k in keys), (step, a[step], b[step])
        n = int(a[step].get("train/tokens", 1))
        for key in keys:
            rtol = f32_rtol(max(n, 1000), updates=step)  # at least 1000 terms: the eval's sums
            assert b[step][key] == pytest.approx(a[step][key], rel=rtol, abs=1e-6), (key, step, a[step], b[step])
            gaps["rel"] = max(gaps["rel"], abs(b[step][key] - a[step][key]) / max(abs(a[step][key]), 1e-12))
    base, wa, wb = weights(embedded.resolve_model(MOE)), weights(one / "hf"), weights(ep / "hf")
    assert wa.keys() == wb.keys() == base.keys()
    assert any(".experts.gate_up_proj" in k for k in base)  # the experts as transformers holds them: (E, 2·ffn, d)
    tokens = sum(int(a[s]["train/tokens"]) for s in range(1, STEPS + 1))
    for k in wa:
        assert wa[k].shape == wb[k].shape == base[k].shape, k  # whole experts, not one rank's share
        moved = (wa[k] - base[k]).norm()
        assert moved > 0, f"{k} did not train"
        gap = (wb[k] - wa[k]).norm() / moved
        gaps["weights"] = max(gaps["weights"], gap.item())
        assert gap <= 2 * f32_rtol(tokens, updates=STEPS), (k, gap.item())  # 2: Adam's m and √v both carry it
    return gaps


def test_two_rank_expert_parallel_engine_trains_like_data_parallel_at_zero_0_2_3(tmp_path):
    """tests/expert_parallel_worker.py: `make_engine` with `--ds.expert-parallel-size 2` on 2 ranks (each holding 2 of
    every layer's 4 experts) against the same 2 ranks holding all 4, 3 AdamW steps at lr 1e-2 on the same data split:
    the same losses and gradient norm at ZeRO 0, 2 and 3 (at ZeRO-0 the norm core computes sums the experts' squares
    over the group: every rank clips by the same norm), whole weights under the HF names and shapes for the export
    (the tied head, dropped by the export, aside) and the weight sync, and no partition sent as it is."""
    out = tmp_path / "results.json"
    embedded.ensure_tiny_moe()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).with_name("expert_parallel_worker.py")), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env={**child_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    base = results.pop("base")
    n = 8 * 16 * STEPS  # tokens of the 3 steps
    for case, r in results.items():
        one, ep = r["ep1"], r["ep2"]
        for step in range(STEPS):
            rtol = f32_rtol(8 * 16, updates=step)
            assert ep["loss"][step] == pytest.approx(one["loss"][step], rel=rtol), (case, step)
            assert len(set(ep["norms"][step])) == 1, (case, step, ep["norms"])  # one norm on every rank
            assert ep["norms"][step][0] == pytest.approx(one["norms"][step][0], rel=rtol), (case, step)
        assert ep["state"] == {k: v for k, v in base.items() if k != "lm_head.weight"}, case
        assert ep["sync_names"] == one["sync_names"], case
        assert ep["moved"] > 0, case  # every tensor trained
        assert ep["gap"] <= 2 * f32_rtol(n, updates=STEPS), (case, ep["gap_at"], ep["gap"])
    assert "AutoEP" in results["zero3"]["ep2"]["zero3_partitions"]
    assert results["zero3"]["ep1"]["zero3_partitions"] == ""  # without AutoEP they are sent as they are


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """sft.py on 2 ranks (ZeRO-2, the default) without expert parallelism, and with it halted after 2 steps."""
    embedded.ensure_tiny_moe()
    tmp = tmp_path_factory.mktemp("ep_sft")
    one = run_script("sft", tmp, "ep1", 2)
    halted = run_script("sft", tmp, "ep2", 2, "--ds.expert-parallel-size", "2", "--train.halt-after", "2")
    return tmp, one, halted


@pytest.mark.slow
def test_sft_expert_parallel_2_halted_and_resumed_equals_expert_parallel_1(sft_runs):
    """EP=2 over 2 ranks, halted after 2 steps (DeepSpeed writes each (layer, expert) to a file of its own) and
    resumed, trains, evaluates (greedy generation with every rank stepping until all are done) and exports what the
    same 2 ranks do without expert parallelism; resumed without it in between, with `--ckpt.allow-changes`, it is
    refused."""
    tmp, one, halted = sft_runs
    assert sorted(rows(halted)) == [0, 1, 2] and not (halted / "hf").exists()
    experts = sorted(p.name for p in halted.glob("checkpoints/step_*/model/layer_*_expert_*_model_states.pt"))
    assert experts == [f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt" for i in (0, 1) for e in range(4)]
    with pytest.raises(AssertionError, match=r"saved with --ds.expert-parallel-size 2, resumed with 1; "
                                             r"--ckpt.allow-changes cannot change it"):  # fmt: skip
        run_script("sft", tmp, "ep2", 0, "--ckpt.allow-changes")
    resumed = run_script("sft", tmp, "ep2", 2, "--ds.expert-parallel-size", "2")
    assert [json.loads(line)["step"] for line in open(resumed / "metrics.jsonl")] == list(range(STEPS + 1))
    gaps = assert_same_run(one, resumed, ("loss/sft", "loss/router_aux"))
    print(f"sft EP=2 vs EP=1: largest relative metric gap {gaps['rel']:.2e}, weights {gaps['weights']:.2e}")


@pytest.mark.slow
def test_dpo_expert_parallel_2_equals_expert_parallel_1(tmp_path):
    """dpo.py (shared-prompt rows, a 4-D attention mask; the reference log-probs from the policy before its first
    step) with EP=2 over 2 ranks logs the losses, margins, gradient norms and held-out metrics and exports the whole
    experts that the same 2 ranks do without expert parallelism."""
    embedded.ensure_tiny_moe()
    one = run_script("dpo", tmp_path, "ep1", 2)
    ep = run_script("dpo", tmp_path, "ep2", 2, "--ds.expert-parallel-size", "2")
    gaps = assert_same_run(one, ep, ("loss/dpo", "loss/nll", "train/margin", "train/chosen_logp"))
    print(f"dpo EP=2 vs EP=1: largest relative metric gap {gaps['rel']:.2e}, weights {gaps['weights']:.2e}")


# ------------------------------------------------------------------------------------------------- refusals


def _sft_args(**ds):
    from algos.sft import Args

    args = Args()
    args.ds = DSConfig(expert_parallel_size=2, **ds)
    return args


@pytest.mark.parametrize("change, message", [
    (lambda a: setattr(a.ds, "tensor_parallel_size", 2), "--ds.expert-parallel-size 2 with --ds.tensor-parallel-size 2"),
    (lambda a: setattr(a.ds, "optimizer", "muon"), "--ds.expert-parallel-size 2 with --ds.optimizer muon"),
    (lambda a: setattr(a.ds, "compile", True), "--ds.expert-parallel-size 2 with --ds.compile"),
    (lambda a: setattr(a.train, "sp_size", 2), "--ds.expert-parallel-size 2 with --train.sp-size 2"),
    (lambda a: setattr(a.model, "lora_rank", 4), r"--ds.expert-parallel-size 2 with LoRA or 4-bit weights \(--model"),
    (lambda a: setattr(a.model, "load_in_4bit", True), "--ds.expert-parallel-size 2 with LoRA or 4-bit weights"),
], ids=["tp", "muon", "compile", "sp", "lora", "4bit"])  # fmt: skip
def test_sft_flags_expert_parallelism_is_not_built_for_are_refused_before_anything_loads(change, message,
                                                                                         nothing_loads):  # fmt: skip
    args = _sft_args()
    check_args(args)  # alone: accepted
    change(args)
    with pytest.raises(ValueError, match=message):
        check_args(args)


def test_rl_flags_are_refused_before_a_launch_naming_both():
    from algos.grpo import Args

    args = Args()
    args.ds.expert_parallel_size, args.train.ranks = 2, 3
    with pytest.raises(ValueError, match="--ds.expert-parallel-size 2 with --train.ranks 3: must divide"):
        check_args(args)
    args.train.ranks, args.actor.routing_replay = 2, True
    with pytest.raises(ValueError, match="--ds.expert-parallel-size 2 with --actor.routing-replay"):
        check_args(args)


@pytest.mark.parametrize("name, message", [
    ("cleanrlhf/tiny", r"--ds.expert-parallel-size 2 with a dense model \(--model.name-or-path / "
                       r"--actor.model.name-or-path: model_type qwen2 has no experts\)"),
    (MOE, r"--ds.expert-parallel-size 2: must divide the number of ranks \(1\) and of experts \(4\)"),
], ids=["dense", "one-rank"])  # fmt: skip
def test_make_engine_refuses_a_model_or_world_before_deepspeed_starts(name, message):
    model = models.load_causal_lm(ModelConfig(name_or_path=name))
    with pytest.raises(ValueError, match=message):
        ds_engine.make_engine(model, DSConfig(expert_parallel_size=2), 1e-3)
    with pytest.raises(ValueError, match="with a scalar-head model"):
        ds_engine.make_engine(models.TokenValues(model), DSConfig(expert_parallel_size=2), 1e-3)


# ------------------------------------------------------------------------------------------------- GRPO actor

DIGITS = (  # a reward with spread whatever a random model writes: the share of digits in the response
    "import torch\n\n\n"
    "def reward_func(queries, prompts, labels):\n"
    "    answers = [q[len(p):] for q, p in zip(queries, prompts)]\n"
    "    return torch.tensor([sum(c.isdigit() for c in a) / max(len(a), 1) for a in answers])\n"
)


@pytest.mark.slow
def test_grpo_actor_with_expert_parallel_2_halted_and_resumed_trains_like_one_process(tmp_path):
    """`--train.ranks 2 --ds.expert-parallel-size 2` on the tiny MoE (ZeRO-3; the vLLM engine a colocated Ray actor,
    the only engine layout of a multi-rank RL run: `--vllm.engine hf` and an in-process vLLM run in a one-rank
    trainer's process), halted after the first step (a checkpoint of the actor's partitioned experts) and resumed for
    the second, against one process holding every expert (`conftest.ranks_2_vs_1`: the first step's samples agree):
    the steps' policy loss, gradient norm, clip fraction and rewards are one process's, and `--debug` checks after every
    sync (the resumed run's first included) that the engine, which got whole experts under the HF names, computes the
    trainer's log-probs."""
    from conftest import ranks_2_vs_1

    from algos.grpo import Args, main

    (tmp_path / "digits_reward.py").write_text(DIGITS)

    def configure(args, ranks: int) -> None:
        args.actor.model.name_or_path, args.vllm.dtype = MOE, "float32"
        args.algo.filter_zero_variance, args.reward.func = False, str(tmp_path / "digits_reward.py")
        if ranks == 2:  # the first step here, halted; ranks_2_vs_1's own run of the same args resumes it
            args.ds.expert_parallel_size, args.train.halt_after = 2, 1
            assert main(args)["halted"]
            saved = next(Path(args.run_dir).glob("checkpoints/step_*/actor/zero_pp_rank_0_mp_rank_00_model_states.pt"))
            layers = torch.load(saved, weights_only=False)["ds_autoep_layers"]  # ZeRO-3: the experts in partitions
            assert [(x["num_experts"], x["ep_size"]) for x in layers] == [(4, 2), (4, 2)]
            args.train.halt_after = None

    rows = ranks_2_vs_1(Args, main, tmp_path, configure)
    assert [r["step"] for r in rows[2]] == [r["step"] for r in rows[1]] == [1, 2]  # step 2 from the checkpoint
    gaps = {(k, s): abs(rows[2][s][k] - rows[1][s][k]) / abs(rows[1][s][k]) for s in range(2) for k in rows[1][s]
            if k.split("/")[0] in ("loss", "train") and rows[1][s][k]}  # fmt: skip
    print("grpo EP=2 vs one process: largest relative gaps", sorted(gaps.items(), key=lambda kv: -kv[1])[:4])
    for step in range(2):  # 16 prompts x 4 samples of <= 16 tokens
        # not the router's loss: the logged one is of a forward's own rows (f_i · P_i over them, not linear in the
        # rows), and one process's forwards hold other rows than a rank's (7.5e-5 apart at step 1, 3e-4 at step 2)
        for key in ("loss/policy", "train/grad_norm", "loss/clipfrac", "rollout/reward_mean"):
            rtol = max(1e-4, f32_rtol(16 * 4 * 16, updates=step))
            assert rows[2][step][key] == pytest.approx(rows[1][step][key], rel=rtol, abs=1e-6), (key, step)
        assert rows[2][step]["perf/debug_check_s"] > 0  # the engine == trainer check ran after the sync
