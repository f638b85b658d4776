"""Run a script of the project with your copy of one of its core modules in place of the real one:

    python docs/course/run_with.py core.rl_math=docs/course/exercises/04_kl.py algos/grpo.py --train.max-steps 20

Your file is loaded as `core.rl_math` before the script imports anything, so every `from core import rl_math` (the
scripts, core/rl.py, core/samples.py) gets your functions. The script then runs as `python <script> <flags>` would.
One process only: with `--train.ranks N > 1` the Ray ranks import the real module.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path


def install(name: str, path: Path) -> None:
    """Load `path` as the module `name` (e.g. core.rl_math), in sys.modules and as its package's attribute."""
    if not path.is_file():
        raise SystemExit(f"run_with: {path}: no such file")
    package, _, leaf = name.rpartition(".")
    parent = importlib.import_module(package) if package else None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if parent is not None:
        setattr(parent, leaf, module)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or "=" not in argv[0]:
        raise SystemExit("usage: python docs/course/run_with.py <module>=<your file> <script> [flags ...]")
    name, _, path = argv[0].partition("=")
    install(name, Path(path))
    script = argv[1]
    sys.argv = [script, *argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
