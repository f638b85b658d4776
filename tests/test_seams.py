"""The seams between core's modules and the scripts: no import cycles in core (lazy imports included), scripts that
leave embedded names to the loaders, and the RL warm start built by sft.py through a preset sft.py defines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import tyro

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "rewards", "agents")


def _project_imports(path: Path) -> set[str]:
    """Project modules (`core.x`, `rewards.x`, `agents.x`) that `path` imports anywhere, function bodies included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            if node.module in PACKAGES:  # `from core import rollout, embedded`
                out |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return {m for m in out if (ROOT / (m.replace(".", "/") + ".py")).exists()}


def _graph() -> dict[str, set[str]]:
    return {f"{p.parent.name}.{p.stem}": _project_imports(p) for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")
            if p.stem != "__init__"}  # fmt: skip


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def _fields(paths, skip=()) -> dict[str, set[str]]:
    """Dataclass-style fields declared in `paths` (annotated class attributes), by name -> {"file:Class"}."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in skip:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        out.setdefault(item.target.id, set()).add(f"{path.name}:{node.name}")
    return out


def _script_only_reads(core_files) -> list[str]:
    """Where `core_files` read a field that only a script declares (in its `AlgoArgs`, its own section subclass such
    as grpo_async's `--train.max-lag`, its critic section, ...): `x.field` not called as a method. A script's knob
    reaches core as a value the script passes, so a fork that renames or drops it cannot break core."""
    shared = _fields([p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")])
    owned = {f: w for f, w in _fields(sorted((ROOT / "algos").glob("*.py")), skip=("Args",)).items() if f not in shared}
    found = []
    for path in core_files:
        tree = ast.parse(path.read_text())
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        found += [f"{path.name}:{n.lineno} reads .{n.attr} ({', '.join(sorted(owned[n.attr]))})" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr in owned and id(n) not in called]  # fmt: skip
    return found


def test_core_reads_no_field_only_a_script_declares(tmp_path):
    assert not _script_only_reads(sorted((ROOT / "core").glob("*.py")))
    leak = tmp_path / "leak.py"  # the check itself: a core file reading grpo_async's own --train.max-lag is found
    leak.write_text("def start(args):\n    return args.train.max_lag, args.rollout.generate()\n")
    assert _script_only_reads([leak]) == ["leak.py:2 reads .max_lag (grpo_async.py:TrainArgs)"]


def _writes_into_args(path: Path) -> list[str]:
    """Assignments in `path` to an attribute of a name `args` or `cfg` (`args.run_dir = ...`, `args.data.max_len =
    ...`, `setattr(cfg, ...)`): core returns what it resolves (a copy, a value) instead."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            root = t
            while isinstance(root, ast.Attribute):
                root = root.value
            if t is not root and isinstance(root, ast.Name) and root.id in ("args", "cfg"):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_core_writes_nothing_into_the_scripts_args(tiny_path, tmp_path):
    """Statically: no core module assigns into a script's `Args` (the run folder, the engines' mode, the resolved
    --data.max-len, the built embedded models' folders: the ranks get a copy); and `rl.load_task` leaves `args` as
    it was while it resolves --data.max-len from the model."""
    import copy

    from algos.grpo import Args
    from core import rl

    assert not [w for p in sorted((ROOT / "core").glob("*.py")) for w in _writes_into_args(p)]
    leak = tmp_path / "leak.py"
    leak.write_text("def f(args):\n    args.vllm.in_process = False\n    setattr(args, 'run_dir', 'x')\n")
    assert _writes_into_args(leak) == ["leak.py:2", "leak.py:3"]
    args = Args()
    args.actor.model.name_or_path, args.eval.max_samples = str(tiny_path), 8
    before = copy.deepcopy(args)
    rl.load_task(args)
    assert args == before and args.data.max_len is None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_core_has_no_import_cycles_lazy_imports_included():
    """embedded <-> preference and placement <-> rollout were cycles (one side importing inside a function)."""
    graph = _graph()
    assert graph["core.rl"] and "core.embedded" in graph["core.data"]  # the walk sees real imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert not graph["core.embedded"], "embedded.py builds artifacts from nothing: it imports no project module"
    assert "core.placement" not in graph["core.rollout"]


LAYERS = ("core", "rewards", "agents", "algos")  # each folder imports only the folders before it


def test_the_folders_import_downward_only():
    """Drawn file by file and folder by folder, every import runs down the layers: core below rewards (which score
    with core's models), below agents (executors, environments, the server), below the scripts, which wire the
    pieces and hand them to core. No arrow runs back up and there is no cycle, at either scale."""
    graph = _graph() | {f"algos.{p.stem}": _project_imports(p) for p in (ROOT / "algos").glob("*.py")}
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                if LAYERS.index(b.split(".")[0]) > LAYERS.index(a.split(".")[0]))  # fmt: skip
    assert up == [], up
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    folders = {f: {b.split(".")[0] for a, deps in graph.items() if a.startswith(f + ".") for b in deps} - {f}
               for f in LAYERS}  # fmt: skip
    assert _cycle(folders) is None and "agents" in folders["algos"] and "core" in folders["rewards"]


# The functions of the RL loop's plumbing that may take a script's whole `Args`: the launch and start functions.
WHOLE_ARGS = {"core/rl.py": {"load_task", "make_actor", "start"}, "core/launch.py": {"launch", "_run_rank"},
              "core/producer.py": {"start_engines", "start"}, "core/samples.py": set()}  # fmt: skip


@pytest.mark.parametrize("path", sorted(WHOLE_ARGS))
def test_core_takes_the_sections_it_reads(path):
    """Past the launch and start functions, the RL plumbing takes the sections it reads (`args.train`, `args.rollout`,
    ...), never the whole `Args` (a parameter named `args`), and core probes no section with `getattr(args, ...)`."""
    tree = ast.parse((ROOT / path).read_text())
    takes_args = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                  if any(a.arg == "args" for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs)}  # fmt: skip
    assert takes_args <= WHOLE_ARGS[path], sorted(takes_args - WHOLE_ARGS[path])
    probes = [p.name for p in (ROOT / "core").glob("*.py") for probe in ('getattr(args, "', "getattr(args, '")
              if probe in p.read_text()]  # fmt: skip
    assert probes == [], probes

@pytest.mark.parametrize("script", ["grpo", "rloo", "reinforce_pp", "ppo", "grpo_async", "cispo", "sapo", "opd", "dppo",
                                    "gmpo", "gdpo", "opsd", "sft", "dpo", "kto", "rm"])  # fmt: skip
def test_scripts_leave_embedded_names_to_the_loaders(script):
    assert "core.embedded" not in _project_imports(ROOT / "algos" / f"{script}.py")


def test_loaders_resolve_embedded_names(tmp_path, monkeypatch, tiny_path):
    """The model loaders, the rollout engines and `data.resolve_data` map every embedded name themselves."""
    from core import data, models, rollout

    assert models.max_positions("cleanrlhf/tiny") > 0
    assert models.load_tokenizer("cleanrlhf/tiny").pad_token_id is not None
    assert "embedded.resolve_model" in Path(rollout.__file__).read_text()
    assert (Path(data.resolve_data("cleanrlhf/add2")) / "train.jsonl").is_file()
    monkeypatch.chdir(tmp_path)
    assert data.resolve_data("mine.jsonl") == "mine.jsonl"


# The recipe of `cleanrlhf/tiny-sft` as flags (versions 6-8 were built from them): the preset must equal them.
WARM_START_FLAGS = [
    "--model.name-or-path", "cleanrlhf/tiny", "--data.path", "cleanrlhf/add2", "--train.lr", "1e-3",
    "--train.adam-betas", "0.9", "0.98", "--train.batch-size", "64", "--train.max-steps", "3000",
    "--train.warmup-steps", "0", "--eval.every", "20", "--eval.generate", "--eval.stop-at-accuracy", "0.45",
    "--eval.max-samples", "500", "--ckpt.every", "0", "--logger.quiet",
]  # fmt: skip


def test_warm_start_preset_is_the_recipe_and_later_flags_win():
    sft = importlib.import_module("algos.sft")
    assert sft.cli(["--preset", "warm-start"]) == tyro.cli(sft.Args, args=WARM_START_FLAGS)
    changed = sft.cli(["--preset", "warm-start", "--train.max-steps", "7", "--export-dir", "out"])
    assert (changed.train.max_steps, changed.export_dir, changed.train.lr) == (7, "out", 1e-3)
    assert sft.cli([]) == sft.Args()
    with pytest.raises(SystemExit, match="warm-start"):
        sft.cli(["--preset", "nope"])
    assert '"--preset", "warm-start"' in (ROOT / "core" / "embedded.py").read_text()  # the builder uses it


# ------------------------------------------------------------------ one story per script: the RL scripts' shape
# Changed lines of `diff algos/grpo.py algos/<script>.py` at most: everything else is shared, word for word. (What
# a script traces for samples.jsonl is its own: no KL in reinforce_pp's loss, PPO's values, OPD's teacher log-probs;
# OPD's refusals of a negative task-reward weight and of a reward model as its teacher are its own too, as OPSD's hint
# prompts and their alignment are; so are PPO's
# critic fields, LoRA and 4-bit included, whose loading and checks are core's; and the math only one script uses:
# ppo.py's GAE and value loss, reinforce_pp.py's discounted returns.)
DIFF_TARGETS = {"rloo": 70, "reinforce_pp": 142, "grpo_async": 133, "ppo": 397, "cispo": 80, "sapo": 80, "opd": 194,
                "dppo": 125, "gmpo": 92, "gdpo": 100, "opsd": 250}


def _changed_lines(a: Path, b: Path) -> int:
    import difflib

    ops = difflib.SequenceMatcher(None, a.read_text().splitlines(), b.read_text().splitlines(), autojunk=False)
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops.get_opcodes() if tag != "equal")


def _step_loop_depth(path: Path) -> int:
    """How many blocks deep the body of `for step in ...` goes (the loop's own body is depth 0)."""
    loops = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.For)
             and isinstance(n.target, ast.Name) and n.target.id == "step"]  # fmt: skip
    assert loops, f"{path.name}: no `for step in ...` loop"

    def depth(stmts) -> int:
        deepest = 0
        for s in stmts:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(s, field, None)
                if inner and isinstance(inner, list) and isinstance(inner[0], ast.stmt | ast.excepthandler):
                    deepest = max(deepest, 1 + depth(inner))
        return deepest

    return max(depth(loop.body) for loop in loops)


@pytest.mark.parametrize("script", sorted(DIFF_TARGETS))
def test_rl_scripts_differ_from_grpo_only_by_their_algorithm(script):
    changed = _changed_lines(ROOT / "algos" / "grpo.py", ROOT / "algos" / f"{script}.py")
    assert changed <= DIFF_TARGETS[script], f"grpo.py -> {script}.py: {changed} changed lines"


@pytest.mark.parametrize("script", ["grpo", *sorted(DIFF_TARGETS)])
def test_rl_scripts_are_short_and_shallow(script):
    path = ROOT / "algos" / f"{script}.py"
    assert _step_loop_depth(path) <= 4
    assert _depth_into_update(path) <= 5  # for step > with > for epoch > for minibatch > for micro-batch
    text = path.read_text()
    assert "def policy_loss(" in text  # the loss is written out in the script
    if script not in ("cispo", "sapo", "dppo", "gmpo"):  # those replace the clip: their own surrogates (opd keeps GRPO's)
        assert "-torch.min(surr, surr_clipped)" in text
    if script == "grpo":
        assert len(path.read_text().splitlines()) <= 300  # one story that stays short


def _depth_into_update(path: Path) -> int:
    """Blocks nested from `for step` (1) down to the innermost block of the script's `update`, through the block
    that calls it: `for step` > `with timer` > `for epoch` > `for minibatch` > `for micro-batch` is 5."""
    tree = ast.parse(path.read_text())
    (update,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "update"]
    (loop,) = [n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
               and n.target.id == "step"]  # fmt: skip

    def blocks(stmts) -> int:  # the deepest nesting of blocks inside `stmts`
        return max((1 + blocks(inner) for s in stmts for f in ("body", "orelse", "finalbody", "handlers")
                    if isinstance(inner := getattr(s, f, None), list) and inner and isinstance(inner[0], ast.stmt)),
                   default=0)  # fmt: skip

    def call_depth(stmts, d: int) -> int | None:  # blocks around the simple statement that calls update()
        for s in stmts:
            inner = [getattr(s, f) for f in ("body", "orelse") if isinstance(getattr(s, f, None), list)]
            if not inner and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "update"
                                 for c in ast.walk(s)):  # fmt: skip
                return d
            for body in inner:
                if (found := call_depth(body, d + 1)) is not None:
                    return found
        return None

    return 1 + call_depth(loop.body, 0) + blocks(update.body)


def test_sft_help_names_its_presets(capsys):
    """`--preset` is handled before tyro sees the flags: `--help` must still say it exists and what each preset is."""
    sft = importlib.import_module("algos.sft")
    with pytest.raises(SystemExit):
        sft.cli(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--preset NAME" in out and "warm-start (The RL warm start `cleanrlhf/tiny-sft`" in out, out[:600]
