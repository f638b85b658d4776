"""The docs quote the code: every dotted flag the README, the course and the docs pages name is a flag of a script (or
of `rewards.server`), every `test_file.py::test_name` they cite is a test that exists, every file
path they name exists, and the counts the README states (RL scripts, lessons, exercises) are the repository's. A
renamed flag or test then fails here instead of drifting silently."""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("sft", "dpo", "kto", "rm", "grpo", "grpo_async", "rloo", "reinforce_pp", "ppo", "opd", "cispo", "sapo", "dppo", "gmpo", "gdpo", "opsd")
RL_SCRIPTS = ("grpo", "grpo_async", "rloo", "reinforce_pp", "ppo", "opd", "cispo", "sapo", "dppo", "gmpo", "gdpo", "opsd")
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "algos").glob("*.md"),
                *(ROOT / "docs" / "course").glob("*.md")])  # fmt: skip
DOTTED = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*(?:\.[a-z0-9-]+)+)")
# Old names the docs quote as old (a changelog row, a migration note): each is refused by the scripts.
OLD_NAMES = {"train.max-tokens-per-micro-batch"}
CITED_TEST = re.compile(r"(?:tests/)?(test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)")


def _flags(cls, prefix: str = "") -> set[str]:
    """The flags tyro makes of a dataclass's fields, nested sections included: `--a.b-c`, and `--a.no-b-c` for a
    boolean."""
    out = set()
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        name = prefix + f.name.replace("_", "-")
        kind = hints[f.name]
        inner = [a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)] or [kind]
        if dataclasses.is_dataclass(inner[0]):
            out |= _flags(inner[0], name + ".")
            continue
        out.add(name)
        if kind is bool or bool in typing.get_args(kind):
            head, _, last = name.rpartition(".")
            out.add(f"{head}.no-{last}" if head else f"no-{last}")
    return out


def known_flags_of(scripts) -> set[str]:
    flags = set()
    for name in scripts:
        flags |= _flags(importlib.import_module(f"algos.{name}").Args)
    return flags


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    from rewards.server import ServerArgs

    return known_flags_of(SCRIPTS) | _flags(ServerArgs)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_dotted_flag_a_page_names_exists(page, known_flags):
    text = page.read_text()
    named = {m for m in DOTTED.findall(text) if not m.endswith((".", "-"))} - OLD_NAMES  # `--algo.clip-*`: a glob
    unknown = sorted(f for f in named if f not in known_flags and not any(k.startswith(f + ".") for k in known_flags))
    assert unknown == [], f"{page.relative_to(ROOT)} names flags no script has: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_test_a_page_cites_exists(page):
    missing = []
    for file, test in CITED_TEST.findall(page.read_text()):
        path = ROOT / "tests" / file
        if not path.exists() or not re.search(rf"^def {test}\(", path.read_text(), re.M):
            missing.append(f"{file}::{test}")
    assert missing == [], f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"


def test_every_file_the_readme_links_exists():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == [], missing


def test_the_counts_the_readme_states_are_the_repositorys():
    readme = (ROOT / "README.md").read_text()
    course = ROOT / "docs" / "course"
    lessons = sorted(course.glob("[0-9][0-9]_*.md"))
    exercises = sorted((course / "exercises").glob("[0-9][0-9]_*.py"))
    assert "ten lessons" in readme and len(lessons) == 10, [p.name for p in lessons]
    assert "lessons 1-8 and 10 each with an exercise" in readme and [p.name[:2] for p in exercises] == [
        f"{i:02d}" for i in (*range(1, 9), 10)]
    assert f"all {len(RL_SCRIPTS)} RL scripts" in readme and all((ROOT / "algos" / f"{s}.py").exists() for s in RL_SCRIPTS)
    from test_fork import RL_SCRIPTS as forked  # the renamed-copies test runs each of them

    assert sorted(forked) == sorted(RL_SCRIPTS)
    assert not OLD_NAMES & known_flags_of(SCRIPTS)
    for script in SCRIPTS:  # the table has a row for every script
        assert f"[`algos/{script}.py`](algos/{script}.py)" in readme, script
