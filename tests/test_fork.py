"""What you fork is what trains: every algorithm choice of an RL script lives in the script. Core reads none of the
fields a script declares (a copy with every one renamed still runs: `AlgoArgs`, a critic's or teacher's section, its
own `--train.*` knobs), the recipe is the script's (a copy's changed recipe is what its run uses), the scripts log the
same names for what they share, and a step whose filter dropped every sample says so instead of passing silently."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RL_SCRIPTS = ("grpo", "rloo", "reinforce_pp", "grpo_async", "ppo", "cispo", "sapo", "opd", "dppo", "gmpo", "gdpo", "opsd")
# what every RL script logs for what they share (loss/kl: with the KL term on; loss/entropy: with the bonus on)
SHARED = {"rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_frac", "rollout/kept_frac",
          "train/grad_norm", "train/tokens", "train/lr", "train/kl_coef", "perf/gen_s", "perf/train_s", "perf/sync_s",
          "perf/tokens_per_s", "loss/policy", "loss/clipfrac", "loss/entropy", "loss/kl"}  # fmt: skip


def test_core_reads_no_field_a_script_owns():
    """No `args.algo` (nor `.algo.` through another name) in core/: a script passes its choices as values."""
    found = [f"{p.name}:{i}" for p in sorted((ROOT / "core").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\.algo\b", line.split("#")[0]) and "`args.algo`" not in line]  # fmt: skip
    assert not found, found


def renamed_copy(script: str, folder: Path, recipe: dict[str, str] | None = None) -> tuple[object, dict[str, str]]:
    """`algos/<script>.py` copied with every field the script owns renamed `x_<field>` (its declaration and every
    `args.<section>.<field>`): the fields of the section classes it declares itself (`AlgoArgs` under `algo`, ppo.py's
    `CriticArgs` under `critic`, grpo_async.py's own `TrainArgs` knobs) that no core, rewards or agents class
    declares too (`ranks`, `zero_stage`, ... are the interface core's `group` reads of any model's section), and the
    recipe lines named in `recipe` ({"ACTOR": "dict(...)"}) replaced; imported. Returns the module and {old: new}."""
    from test_seams import PACKAGES, _fields

    shared = _fields([p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")])
    text = (ROOT / "algos" / f"{script}.py").read_text()
    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "Args"}
    (args_cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    sections = {ast.unparse(n.annotation): n.target.id for n in args_cls.body if isinstance(n, ast.AnnAssign)}
    lines, renames = text.splitlines(keepends=True), []
    for name, cls in classes.items():
        for n in cls.body:  # the declarations
            if isinstance(n, ast.AnnAssign) and name in sections and n.target.id not in shared:
                i = n.lineno - 1
                lines[i] = lines[i].replace(f"{n.target.id}:", f"x_{n.target.id}:", 1)
                renames.append((sections[name], n.target.id))
    text = "".join(lines)
    for section, f in renames:
        text = re.sub(rf"\bargs\.{section}\.{f}\b", f"args.{section}.x_{f}", text)
    for name, value in (recipe or {}).items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, count=1, flags=re.M)
        assert n == 1, name
    fields = [f for _, f in renames]
    path = folder / f"{script}_renamed.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module, {f: f"x_{f}" for f in fields}


@pytest.mark.slow
def test_copies_with_renamed_algo_fields_run_and_log_the_same_names(tmp_path, one_thread):
    """Each RL script, copied with its `AlgoArgs` fields renamed, runs one step with the KL term and the entropy bonus
    on (core would fail on a field it reads by name), and every script logs the shared names."""
    names = {}
    # the copy's recipe: one step of 8 prompts x 4 samples at a constant lr of 2e-4 set for its 16 samples per step
    recipe = {"ACTOR": "dict(lr=2e-4, lr_ref_samples=16, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0, "
                       "adam_betas=(0.9, 0.95))",
              "ROLLOUT": "dict(batch_size=8, n_samples=4)", "TRAIN": "dict(max_steps=1, minibatches=2, epochs=1)"}  # fmt: skip
    for script in RL_SCRIPTS:
        module, renamed = renamed_copy(script, tmp_path, recipe)
        assert len(renamed) >= 5, renamed
        if script in ("grpo_async", "ppo"):  # their own knobs beyond --algo.*: renamed too
            assert {"grpo_async": "max_lag", "ppo": "value_clip"}[script] in renamed, renamed
        args = module.Args()
        assert args.exp_name == f"{script}_renamed"  # a copy names its own runs
        assert (args.train.max_steps, args.rollout.batch_size, args.actor.lr) == (1, 8, 2e-4)  # the copy's recipe
        args.eval.every, args.eval.max_samples = 0, 8
        args.algo.x_entropy_coef = 0.01  # the entropy bonus and the KL term, under their renamed fields
        args.algo.x_kl_coef = 0.05
        if script == "opd":
            args.teacher.model = "cleanrlhf/tiny"  # the student's own starting model: no teacher to build
        if hasattr(args.algo, "x_filter_zero_variance"):
            args.algo.x_filter_zero_variance = False  # a step that trains, whatever the 8 samples score
        args.logger.quiet, args.logger.tensorboard = True, False
        args.run_dir = str(tmp_path / script)
        summary = module.main(args)
        assert summary["steps"] == 1 and summary["steps_without_update"] == 0, summary
        (row,) = [json.loads(line) for line in open(tmp_path / script / "metrics.jsonl") if '"step": 1' in line]
        names[script] = set(row)
        assert row["train/lr"] == pytest.approx(2e-4, rel=1e-6), (script, row["train/lr"])  # the recipe's, unscaled
        # every script keeps its samples with what the loss saw of each token (the KL where the loss has it)
        kept = [r for r in map(json.loads, open(tmp_path / script / "samples.jsonl")) if r["kind"] == "train"]
        assert len(kept) == 8 and all(r["kept"] for r in kept), (script, len(kept))
        saw = {"old_logp", "trainer_logp", "ratio", "advantage", "entropy"} | ({"kl"} if script != "reinforce_pp" else set())
        saw |= {"value"} if script == "ppo" else set()
        assert all(saw <= set(r["tokens"]) for r in kept), (script, sorted(kept[0]["tokens"]))
        # the ratio is the loss's own: 1 in the step's first minibatch (before any update), whichever estimator
        assert all(r["minibatch"] in (0, 1) for r in kept), (script, [r["minibatch"] for r in kept])
        first = [x for r in kept if r["minibatch"] == 0 for x in r["tokens"]["ratio"] if x is not None]
        assert first == pytest.approx([1.0] * len(first), abs=1e-5), script
    for script, logged in names.items():  # SAPO's soft gate clips nothing: it logs its gate weight instead
        shared = SHARED - {"loss/clipfrac"} | {"loss/gate_weight"} if script == "sapo" else SHARED
        assert shared <= logged, (script, sorted(shared - logged))


@pytest.mark.slow
def test_a_step_that_trains_nothing_says_so(tmp_path, one_thread, capsys):
    """A reward that scores every sample alike: every group is dropped by the zero-variance filter, nothing trains.
    The console warns at the first such step, the metrics say kept_frac 0 with no loss, the summary counts the steps."""
    from algos import grpo

    reward = tmp_path / "flat.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [0.5] * len(queries)\n")
    args = grpo.Args()
    args.train.max_steps, args.rollout.batch_size, args.rollout.n_samples = 2, 8, 4
    args.eval.every, args.eval.max_samples = 0, 8
    args.reward.func = str(reward)
    args.logger.tensorboard = False
    args.run_dir = str(tmp_path / "run")
    summary = grpo.main(args)
    assert summary["steps_without_update"] == 2, summary
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["rollout/kept_frac"] for r in trained] == [0.0, 0.0]
    assert not any("loss/policy" in r for r in trained)
    out = capsys.readouterr().out
    assert out.count("trained nothing") == 1 and "every group was filtered out" in out, out[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_without_update"] == 2


def fork_with_a_group_of_its_own(folder: Path):
    """algos/grpo.py copied with a second frozen reference, `ref2`, used only for a logged KL (`ref2/kl`, k3 of the
    sampled tokens against it, ≥ 0 per token): its own `--ref2.*` flags, declared among the script's placed models, built where
    `--ref2.ranks` puts it and asked through `rl.on_model`, all in the copy. Returns the imported module."""
    text = (ROOT / "algos" / "grpo.py").read_text()
    edits = [
        ("    ref: config.RefConfig = field(default_factory=config.RefConfig)\n",
         "    ref: config.RefConfig = field(default_factory=config.RefConfig)\n"
         "    ref2: config.RefConfig = field(default_factory=config.RefConfig)\n"
         '    """a second frozen reference, only for the logged `ref2/kl`."""\n'),
        ('              "reward": reward_group(args.reward)}',
         '              "ref2": group(args.ref2), "reward": reward_group(args.reward)}'),
        ("    episodes = partial(make_executor,",
         '    ref2 = rl.build_model(groups, "ref2", rl.load_ref, device, args.ref2, args.actor.model, "ref2")\n'
         "    episodes = partial(make_executor,"),
        ("            stats.update(update(actor, ref, seqs,",
         "            ref2_logp = rl.on_model(ref2, rl.logp_table, seqs, args.train, args.rollout.temperature, step,\n"
         "                                  run=run)  # on its own ranks\n"
         '            kl2 = rl_math.approx_kl(seqs["rollout_logp"], ref2_logp, "k3", mask=seqs["loss_mask"])\n'
         '            stats["ref2/kl"] = rl_math.masked_mean(kl2, seqs["loss_mask"]).item()\n'
         "            stats.update(update(actor, ref, seqs,"),
    ]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = folder / "grpo_ref2.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_fork_adds_a_model_group_of_its_own_without_touching_core(tmp_path, one_thread, monkeypatch):
    """The copy's `ref2` runs on a Ray rank of its own (`--ref2.ranks 1 --ref2.no-colocate`): the one-process run is
    launched through Ray for it, the group answers one call per step, and the KL it logs is that of the sampled
    tokens against the starting weights: ~0 at the first step (the engine sampled with those weights; only the engine
    and trainer's float rounding differ) and positive once the policy has moved."""
    module = fork_with_a_group_of_its_own(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))  # Ray's workers
    args = module.Args()
    args.train.max_steps, args.rollout.batch_size, args.rollout.n_samples = 3, 8, 4
    args.eval.every, args.eval.max_samples = 0, 8
    args.algo.filter_zero_variance, args.actor.lr = False, 1e-3  # every step trains, the policy moves visibly
    args.ref2.ranks, args.ref2.colocate = 1, False
    args.ray.num_cpus = 4
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    import ray

    try:
        summary = module.main(args)
    finally:
        ray.shutdown()
    assert summary["groups"] == {"ref2": {"ranks": 1, "colocated": False, "calls": 3}}, summary
    kl = [json.loads(line)["ref2/kl"] for line in open(tmp_path / "run" / "metrics.jsonl") if '"ref2/kl"' in line]
    assert len(kl) == 3 and 0 <= kl[0] < 1e-5 and min(kl[1:]) > 1e-4, kl


def test_the_learning_rate_schedule_is_the_scripts(tiny_path):
    """Each training script writes its learning-rate schedule (`lr_schedule`: warm-up, then cosine to a floor) and
    hands it to core (`rl.make_actor(args, device, lr, schedule)`, `make_engine(model, ds, lr, schedule)`; PPO's critic
    too), which the optimizer then follows step by step; core has no schedule of its own (a constant lr without
    one). The scripts' schedules are the formula written here."""
    from core import engine as ds_engine
    from core import models
    from core.config import DSConfig, ModelConfig

    def warmup_cosine(u: int, warmup: int, total: int, floor: float) -> float:
        if u < warmup:
            return (u + 1) / warmup
        return floor + (1 - floor) * (1 + math.cos(math.pi * min(1.0, (u - warmup) / max(1, total - warmup)))) / 2

    for script in [*RL_SCRIPTS, "sft", "dpo", "kto", "rm"]:
        module = importlib.import_module(f"algos.{script}")
        text = Path(module.__file__).read_text()
        assert ("rl.make_actor(args, device, rl.scaled_lr(args.actor, args.rollout, args.train), schedule)"
                if script in RL_SCRIPTS else ", schedule,") in text, script
        if script == "ppo":  # the critic's optimizer follows the script's schedule too
            assert "make_engine(critic, args.ds, args.critic.lr, schedule, hybrid=args.vllm.enable_sleep)" in text
        for warmup, total, floor in ((0, 80, 0.1), (3, 12, 0.2)):
            assert [module.lr_schedule(u, warmup, total, floor) for u in range(total + 3)] == pytest.approx(
                [warmup_cosine(u, warmup, total, floor) for u in range(total + 3)], rel=1e-12), script  # fmt: skip
    assert not hasattr(ds_engine, "lr_lambda")
    ds_engine.init_distributed("gloo")
    torch.manual_seed(0)
    model = models.load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="fp32"))
    steps = lambda u: 1.0 / (u + 1)  # noqa: E731  a fork's own schedule: 1, 1/2, 1/3, ...
    engine = ds_engine.make_engine(model, DSConfig(zero_stage=0), 1e-2, steps)
    ids = torch.randint(3, 20, (4, 8), generator=torch.Generator().manual_seed(1))
    lrs = []
    for step in range(3):
        lrs.append(engine.lr_scheduler.get_last_lr()[0])
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        ds_engine.optimizer_step(engine, step)
    assert lrs == pytest.approx([1e-2, 1e-2 / 2, 1e-2 / 3])
