"""The launch of a run over several processes (`--train.ranks N`, or a model a script places on Ray ranks of its own):
Ray, the placement group, the rollout engine actors, the model groups (`group_layout`, `start_group`) and the trainer
ranks, each running the script's `main`; and, when it fails, where the run stopped and how to resume it. The RL scripts
call `rl.needs_launch` and `rl.launch` (`core.rl` imports them from here).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

from core import checkpoint, embedded, placement, rollout
from core.config import ModelConfig
from core.logger import check_run_dir, run_name
from core.placement import Group


def launch(main, args, placed: dict[str, Group] | None = None) -> dict:
    """`--train.ranks N`: start Ray, the vLLM engine actors and N trainer ranks (one DeepSpeed world) on one placement
    group, and run `main(args, engines, groups)` on every rank, as torchrun would; returns rank 0's summary. The
    models the script placed in groups of their own (`placed`, `group_layout`: e.g. `--ref.ranks`, `--critic.ranks`,
    `--reward.ranks`) get their Ray ranks first, on the trainer's bundles or bundles of their own, and reach every
    rank in `groups` ({role: ModelGroup}); a group's `setup` runs on its ranks here, the script builds the other
    models there (`rl.build_model`). Embedded model names are resolved (built) once here, so that the ranks agree on the
    models and the run folder."""
    check_files(args.run_dir)  # before Ray and the engines start
    layout = group_layout(placed or {}, args.train.ranks)
    if args.train.sp_size > 1 and layout:  # --train.sp-size splits the actor's forwards over trainer ranks only
        raise ValueError(f"--train.sp-size {args.train.sp_size} is not built for models on ranks of their own "
                         f"(--{next(iter(layout))}.ranks)")  # fmt: skip
    resources = placement.init_ray(args.ray)
    gpu, n = resources.get("GPU", 0) > 0, args.train.ranks
    pg, share, engine_options = placement.place_rl(n, args.vllm.num_engines, args.vllm.tensor_parallel_size,
                                                   args.train.colocate, args.ray.strategy, args.ray.timeout_s,
                                                   sum(g.colocate for g in layout.values()))  # fmt: skip
    # the ranks' copy of the script's Args: the embedded models built, one run folder, engine actors (core writes
    # nothing into the script's own Args)
    args = replace(with_model_names(args), vllm=replace(args.vllm, in_process=False),
                   run_dir=str(Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))))  # fmt: skip
    engines = rollout.create_engines(args.actor.model.name_or_path, args.vllm, seed=args.train.seed,
                                     actor_options=engine_options, init_broadcast=False,
                                     tokenizer=args.actor.model.tokenizer,
                                     max_lora_rank=engine_lora_rank(args.actor.model, args.vllm))  # fmt: skip
    group, groups, own_pgs = None, {}, []
    try:
        for role, g in layout.items():
            groups[role] = start_group(args.ray, args.ds, role, g, pg if g.colocate else None, share, gpu, own_pgs)
        group = placement.ModelGroup(placement.Worker, n, "actor", pg=pg, num_cpus_per_rank=share,
                                     num_gpus_per_rank=share if gpu else 0, timeout_s=args.ray.timeout_s,
                                     backend=args.ds.backend)  # fmt: skip
        group.timeout_s = 10 * 365 * 86400.0  # the whole run is one call; a rank that dies still ends it at once
        from core import noise

        summary = group.run(_run_rank, main, args, engines, groups, os.getcwd(), noise.routing())[0]
        if groups:  # what each group did: its ranks and how many calls its rank 0 served
            summary["groups"] = {role: {"ranks": len(g), "colocated": layout[role].colocate,
                                        "calls": g.run(_calls)[0]} for role, g in groups.items()}  # fmt: skip
        return summary
    except Exception as e:  # a rank, an engine or a group died or raised: say where the run stands
        stopped = where_stopped(args.run_dir, args.ckpt.dir, args.exp_name, args.train.max_steps)
        if hasattr(e, "add_note"):  # Python >= 3.11: printed right under the error
            e.add_note(stopped)
        else:
            print(stopped, file=sys.stderr)
        raise
    finally:
        for g in [group, *groups.values()]:
            if g is not None:
                g.shutdown()
        for own in own_pgs:
            import ray

            ray.util.remove_placement_group(own)
        engines.shutdown()


def engine_lora_rank(model: ModelConfig, vllm: rollout.VLLMConfig) -> int:
    """The LoRA rank the rollout engines must serve: the actor's (`model`, `--actor.model.*`) with `--vllm.lora-sync
    adapter`, else 0 (merged weights need no LoRA support in vLLM)."""
    return model.lora_rank if vllm.lora_sync == "adapter" else 0


def needs_launch(train, placed: dict[str, Group] | None = None) -> bool:
    """Whether the run is several processes started through Ray (`launch`): trainer ranks (`train.ranks`, i.e.
    `--train.ranks N`) or a model the script placed in a group of its own (`placed`, see `group_layout`)."""
    return train.ranks > 1 or bool(group_layout(placed or {}, train.ranks))


def group_layout(placed: dict[str, Group], train_ranks: int) -> dict[str, Group]:
    """The groups of `placed` ({role: Group}, the script's declaration) that run on Ray ranks of their own: those
    whose `ranks` is set. A group the script has no use for (`unused`) with ranks, or a colocated one with more ranks
    than the trainer has bundles, is refused naming its `--<role>.ranks` flag."""
    layout = {}
    for role, g in placed.items():
        if g is None or g.ranks is None:
            continue
        if g.unused:
            raise ValueError(f"--{role}.ranks {g.ranks}: there is no {role} model to place ({g.unused})")
        if g.ranks < 1:
            raise ValueError(f"--{role}.ranks {g.ranks}: must be at least 1 (None: in the trainer's processes)")
        if g.colocate and g.ranks > train_ranks:
            raise ValueError(f"--{role}.ranks {g.ranks} colocated: at most one rank per trainer bundle (--train.ranks "
                             f"{train_ranks}); give --{role}.no-colocate for bundles of its own")  # fmt: skip
        layout[role] = g
    return layout


def start_group(ray_cfg: placement.RayConfig, ds, role: str, g: Group, pg, share: float, gpu: bool,
                own_pgs: list) -> placement.ModelGroup:  # fmt: skip
    """One model group of `group_layout`, started: on the trainer's placement group `pg` (rank i on bundle i, `share`
    of it) or, `pg` None, on a placement group of its own (one bundle per rank, appended to `own_pgs`, placed by
    the group's strategy, default `--ray.strategy`), then its `setup` run on every rank. `ray_cfg` and `ds` are the
    `--ray.*` and `--ds.*` sections (timeouts, strategy, the process-group backend)."""
    if pg is None:
        pg, share = placement.make_placement_group(g.ranks, strategy=g.strategy or ray_cfg.strategy,
                                                   timeout_s=ray_cfg.timeout_s), 1.0  # fmt: skip
        own_pgs.append(pg)
    group = placement.ModelGroup(placement.Worker, g.ranks, role, pg=pg, num_cpus_per_rank=share,
                                 num_gpus_per_rank=share if gpu else 0, timeout_s=ray_cfg.timeout_s,
                                 backend=ds.backend, env={"CLEANRLHF_GROUP": role})  # fmt: skip
    if g.setup is not None:  # e.g. the reward model's replicas, which score for every trainer rank
        try:
            group.run(g.setup)
        except Exception:
            group.shutdown()
            raise
    return group


def _calls(worker) -> int:
    return getattr(worker, "calls", 0)


def where_stopped(run_dir: str, ckpt_dir: str | None, name: str, max_steps: int) -> str:
    """One line for a run that failed: the step it was in (one past the last logged), the newest checkpoint (in
    `ckpt_dir`, default `<run_dir>/checkpoints`), and the command that resumes it."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    try:
        ckpt = checkpoint.latest(Path(ckpt_dir or run_dir / "checkpoints"))
    except ValueError:
        ckpt = None
    resume = f"resumes from {ckpt.name}" if ckpt else "starts over (no checkpoint yet; --ckpt.every N saves them)"
    return (f"[{name}] the run stopped during step {max(steps, default=0) + 1} of {max_steps}; "
            f"the same command with --run-dir {run_dir} {resume}")


def _run_rank(worker, main, args, engines, groups: dict, cwd: str, routed: bool = False) -> dict:
    os.chdir(cwd)  # relative paths of the command line mean what they meant to the driver
    if routed:  # as the driver: library messages to run.log, the project's lines (tagged) to the driver's console
        from core import noise

        noise.quiet_libraries(["--run-dir", args.run_dir, "--logger.quiet"], console_tag=True)
    return main(args, engines, groups)


def with_model_names(cfg):
    """A copy of the nested `Args` `cfg` whose `name_or_path` fields that name an embedded model hold its built local
    folder (built here); `cfg` itself unchanged (sections without such a name are shared, not copied)."""
    changes = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value) and (new := with_model_names(value)) is not value:
            changes[f.name] = new
        elif f.name == "name_or_path" and isinstance(value, str) and (local := embedded.resolve_model(value)) != value:
            changes[f.name] = local
    return replace(cfg, **changes) if changes else cfg


def check_files(run_dir: str | None) -> None:
    """A `--run-dir` that is a file (or a folder this run cannot use), refused before anything loads (DeepSpeed, Ray,
    vLLM). The files the episodes read (reward, agent, environment) are the script's to check
    (`agents.make.check_episode_files`)."""
    if run_dir:
        check_run_dir(run_dir)
