"""The course (docs/course/): exercises that are the real files but for one blanked body, checks that pass every
solution (the real code) and fail every blank exercise and a typical planted mistake per lesson with a message that
names it, lesson pages whose links to the real functions resolve, the class table, and (slow) a learning run."""

from __future__ import annotations

import ast
import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

REPO = Path(__file__).resolve().parents[1]
COURSE = REPO / "docs" / "course"
sys.path.insert(0, str(COURSE))

import check  # noqa: E402
import make_exercises  # noqa: E402
from lessons import LESSONS  # noqa: E402

EXERCISED = [n for n, lesson in LESSONS.items() if lesson.function]


def _function(source: str, name: str) -> ast.AST:
    return next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)


@pytest.mark.parametrize("number", EXERCISED)
def test_an_exercise_is_its_real_file_but_for_the_blanked_body(number):
    lesson = LESSONS[number]
    exercise, real = lesson.exercise.read_text(), (REPO / lesson.source).read_text()
    assert exercise == make_exercises.render(lesson), "run python docs/course/make_exercises.py"
    # independently of the generator: drop the header comment, put the real body back, and get the real file
    lines = exercise.splitlines()
    while lines[0].startswith("#"):
        lines.pop(0)
    blank = _function("\n".join(lines), lesson.function)
    body = blank.body[1:]  # after the docstring: the comment line and `raise NotImplementedError`
    assert len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
    start, end = body[0].lineno - 2, body[0].end_lineno  # the comment line is just before the raise
    real_fn = _function(real, lesson.function)
    real_lines = real.splitlines()
    rebuilt = lines[:start] + real_lines[real_fn.body[1].lineno - 1 : real_fn.end_lineno] + lines[end:]
    assert rebuilt == real_lines


@pytest.mark.parametrize("number", EXERCISED)
def test_the_real_code_passes_every_case(number):
    lesson = LESSONS[number]
    results = check.run_cases(lesson, REPO / lesson.source)
    assert len(results) >= 3 and [why for _, why in results if why] == []


@pytest.mark.parametrize("number", EXERCISED)
def test_a_blank_exercise_fails_every_case_saying_it_is_not_written(number):
    lesson = LESSONS[number]
    results = check.run_cases(lesson, lesson.exercise)
    assert results and all("is not written yet" in why for _, why in results), results


# A typical mistake per lesson, planted in the real code: (lesson, text of the real file, its replacement, what the
# message must say). The message names the case and the hint the mistake's values match.
MISTAKES = [
    (1, "/ (group_size - 1)", "/ group_size", "wrong normaliser"),
    (1, "baseline = (r.sum(dim=1, keepdim=True) - r)", "baseline = r.sum(dim=1, keepdim=True)", "expected"),
    (2, "r.std(dim=1, keepdim=True)", "r.std(dim=1, keepdim=True, unbiased=False)", "population std"),
    (2, "(r.std(dim=1, keepdim=True) + eps)", "r.std(dim=1, keepdim=True)", "add eps"),
    (3, "pg = -torch.min(surr, surr_clipped)", "pg = -torch.max(surr, surr_clipped)", "you took the max"),
    (3, "pg = -torch.min(surr, surr_clipped)", "pg = torch.min(surr, surr_clipped)", "loss to minimise"),
    (4, "kl = torch.exp(-delta) - 1.0 + delta", "kl = torch.exp(delta) - 1.0 - delta", "wrong sign"),
    (4, "kl = 0.5 * delta.square()", "kl = delta.square()", "forgot the 1/2"),
    (5, "@torch.no_grad()\ndef gae(", "def gae(", "targets"),
    (5, "adv = delta + gamma * lam * next_adv", "adv = delta + gamma * next_adv", "γ·λ·A"),
    (5, "next_adv = torch.where(valid, adv, next_adv)  # a masked position passes both through unchanged\n"
        "        next_value = torch.where(valid, v[:, t], next_value)", "next_adv, next_value = adv, v[:, t]",
     "taken as a step with V = 0"),  # passes the γ = λ = 1 cases, where both readings agree
    (6, "-F.logsigmoid(chosen - rejected - (0.0 if", "-F.logsigmoid(rejected - chosen - (0.0 if", "sign error"),
    (7, "beta * (policy_chosen_logps - ref_chosen_logps).detach()", "beta * (policy_chosen_logps - ref_chosen_logps)",
     "detach"),
    (7, "F.logsigmoid(beta * h) - label_smoothing", "F.logsigmoid(h) - label_smoothing", "β multiplies h"),
    (5, "adv = delta + gamma * lam * next_adv", "adv = delta + lam * next_adv", "γ is missing from the recursion"),
    (7, "-(1.0 - label_smoothing) * F.logsigmoid(beta * h)", "-(1.0 - label_smoothing) * beta * F.logsigmoid(h)",
     "not −β·log σ(h)"),
    (7, "label_smoothing * F.logsigmoid(-beta * h)", "label_smoothing * F.logsigmoid(beta * h)", "flipped label"),
    (7, "(h - 1.0 / (2.0 * beta)) ** 2", "(h - 1.0 / beta) ** 2", "not 1/β"),
    (8, "prompt=follow_up(question, text)", "prompt=question", "follow_up(question, call)"),
    (10, "(r.std(dim=1, keepdim=True) + eps)", "r.std(dim=1, keepdim=True)", "add eps"),
    (10, "r = parts.view(-1, group_size, parts.shape[1])", "r = parts.sum(dim=1, keepdim=True).view(-1, group_size, 1)",
     "you normalised the sum of the parts"),
    (10, "(per_part * weights).sum(dim=-1)", "per_part.sum(dim=-1)", "the weights changed nothing"),
    (10, "(per_part * weights).sum(dim=-1)", "(per_part * weights.flip(0)).sum(dim=-1)", "the weights are swapped"),
    (10, "return (adv - adv.mean()) / (adv.std() + eps) if adv.numel() > 1 else adv - adv.mean()", "return adv",
     "not whitened"),
    (10, "(adv.std() + eps)", "(adv.std(unbiased=False) + eps)", "population std"),
]  # fmt: skip


def test_a_gae_that_ignores_the_mask_is_told_so(tmp_path):
    """A student's GAE that never reads the mask (padding taken as steps, its V used) fails the padded case with the
    hint that names the mask."""
    wrong = tmp_path / "my_rl_math.py"
    wrong.write_text(
        "import torch\n\n\n@torch.no_grad()\ndef gae(rewards, values, mask, gamma, lam):\n"
        "    adv, nxt_a, nxt_v = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0]), torch.zeros_like(values[:, 0])\n"
        "    for t in reversed(range(rewards.shape[1])):\n"
        "        nxt_a = rewards[:, t] + gamma * nxt_v - values[:, t] + gamma * lam * nxt_a\n"
        "        adv[:, t], nxt_v = nxt_a, values[:, t]\n"
        "    return adv, adv + values\n")  # fmt: skip
    failed = dict((name, why) for name, why in check.run_cases(LESSONS[5], wrong, in_process=True) if why)
    assert "the mask is not applied" in failed["a padded response"], failed


@pytest.mark.parametrize("number, old, new, says", MISTAKES, ids=[f"{m[0]}-{m[3][:16]}" for m in MISTAKES])
def test_a_planted_mistake_fails_with_a_message_that_names_it(tmp_path, number, old, new, says):
    lesson = LESSONS[number]
    real = (REPO / lesson.source).read_text()
    assert real.count(old) == 1, f"the planted mistake's text is not (or not once) in {lesson.source}"
    wrong = tmp_path / Path(lesson.source).name
    wrong.write_text(real.replace(old, new))
    failed = [why for _, why in check.run_cases(lesson, wrong, in_process=True) if why]  # one Python start fewer each
    assert failed, "the planted mistake passes every case"
    assert any(says in why for why in failed), failed
    assert all("expected" in why or "hint" in why or "carry" in why for why in failed), failed


def test_a_file_that_does_not_import_or_lacks_the_function_is_named(tmp_path):
    broken = tmp_path / "02_mine.py"
    broken.write_text("import torch\ndef group_advantages(rewards, group_size:\n")
    [(_, why)] = check.run_cases(LESSONS[2], broken)
    assert "does not import" in why and "SyntaxError" in why
    other = tmp_path / "02_other.py"
    other.write_text("def something_else():\n    pass\n")
    [(_, why)] = check.run_cases(LESSONS[2], other)
    assert "has no function `group_advantages`" in why


def test_an_exception_in_the_students_code_names_its_line(tmp_path):
    mine = tmp_path / "01_mine.py"
    mine.write_text("def rloo_advantages(rewards, group_size):\n    return rewards.view(group_size, -1, 7)\n")
    failed = [why for _, why in check.run_cases(LESSONS[1], mine) if why]
    assert failed and all("RuntimeError" in why and "line 2 of 01_mine.py" in why for why in failed), failed


def test_the_command_line_exit_status_and_the_learning_run_waiting_for_the_cases(tmp_path):
    ok = subprocess.run([sys.executable, str(COURSE / "check.py"), "2", str(REPO / "algos/grpo.py"), "--no-run"],
                        capture_output=True, text=True, timeout=300, env=child_env())  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("ok  ") == 3 and "all 3 cases pass (--no-run: no learning run)" in ok.stdout, ok.stdout
    blank = subprocess.run([sys.executable, str(COURSE / "check.py"), "2", str(LESSONS[2].exercise)],
                           capture_output=True, text=True, timeout=300, env=child_env())  # fmt: skip
    assert blank.returncode == 1 and "the learning run waits for them" in blank.stdout, blank.stdout
    none = subprocess.run([sys.executable, str(COURSE / "check.py"), "9", "x.py"], capture_output=True, text=True)
    assert none.returncode == 2 and "lesson 9 has no exercise" in none.stderr


def test_a_class_is_graded_into_one_table(tmp_path):
    """Two students: one hands in the real code for lessons 1 and 2, the other a blank and a planted mistake."""
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    alice.mkdir(), bob.mkdir()
    shutil.copy(REPO / "algos/rloo.py", alice / "01_baseline.py")
    shutil.copy(REPO / "algos/grpo.py", alice / "02_group_advantage.py")
    shutil.copy(LESSONS[1].exercise, bob / "01_baseline.py")
    grpo = (REPO / "algos/grpo.py").read_text()
    (bob / "02_mine.py").write_text(grpo.replace("r.std(dim=1, keepdim=True)", "r.var(dim=1, keepdim=True)"))
    (bob / "notes.py").write_text("print('not a submission')\n")
    out = subprocess.run([sys.executable, str(COURSE / "check.py"), "--class", str(tmp_path), "--no-run"],
                         capture_output=True, text=True, timeout=600, env=child_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "alice" in out.stdout and "bob" in out.stdout
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert rows["alice"]["lesson 1"] == rows["alice"]["lesson 2"] == "pass (cases)"
    assert rows["alice"]["lesson 3"] == "" and rows["bob"]["lesson 3"] == ""
    assert rows["bob"]["lesson 1"].startswith("fail: ") and rows["bob"]["lesson 2"].startswith("fail: ")


LINK = re.compile(r"`((?:algos|core|agents|rewards)/[\w/]+\.py)::(\w+)`")


@pytest.mark.parametrize("number", sorted(LESSONS))
def test_a_lesson_page_has_its_parts_and_its_links_to_the_code_resolve(number):
    lesson = LESSONS[number]
    page = lesson.page.read_text()
    assert page.startswith(f"# Lesson {number}: {lesson.title}\n"), page[:100]
    for part in ("## The idea", "## The experiment", "## Questions", "## In the real code"):
        assert part in page, part
    links = LINK.findall(page)
    assert links, "a lesson links the functions of the real code that implement it, as `path::function`"
    for path, name in links:
        tree = ast.parse((REPO / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        assert name in names, f"{path}::{name} in {lesson.page.name}"
    if lesson.function:
        assert "## The exercise" in page and f"check.py {number} " in page
        assert f"`{lesson.source}::{lesson.function}`" in page
    for cmd in re.findall(r"^python (algos/\w+\.py|docs/course/\w+\.py)", page, re.M):
        assert (REPO / cmd).is_file(), cmd


def test_the_course_is_linked_from_the_readme_and_lists_every_lesson():
    assert "docs/course/README.md" in (REPO / "README.md").read_text()
    index = (COURSE / "README.md").read_text()
    for lesson in LESSONS.values():
        assert lesson.page.name in index, lesson.page.name
    assert "teacher.md" in index and (COURSE / "teacher.md").is_file()


@pytest.mark.slow
def test_the_learning_run_of_a_core_exercise_trains_with_the_students_module(tmp_path):
    """Lesson 4's check end to end with the real core/rl_math.py as the submission: the cases, then GRPO with the
    k3 KL penalty run through docs/course/run_with.py, whose pass@1 must rise. A marker in the submitted copy
    proves that the script ran the student's module, not the real one."""
    mine = tmp_path / "04_kl.py"
    marker = "\nimport os as _os\nopen(f'{__file__}.{_os.getpid()}', 'w').close()  # which processes loaded it\n"
    mine.write_text((REPO / "core/rl_math.py").read_text() + marker)
    out = subprocess.run([sys.executable, str(COURSE / "check.py"), "4", str(mine), "--work-dir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=900, env=child_env())  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ok   learning run" in out.stdout and "greedy pass@1" in out.stdout
    assert len(list(tmp_path.glob("04_kl.py.*"))) >= 2  # the check's process (the cases) and the run's
    assert (tmp_path / "w" / "run" / "summary.json").exists()


def _experiment_argvs(number: int) -> list[tuple[str, list[str]]]:
    """(script, flags) of every `python algos/<x>.py ...` command of a lesson's experiment, a `for v in a b; do`
    loop's variable set to its first value."""
    import shlex

    sys.path.insert(0, str(COURSE))
    import run_experiment

    text = run_experiment.commands(LESSONS[number].page.read_text()).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        loop = re.match(r"for (\w+) in (\S+)[^;]*; do (.*); done$", line)
        if loop:
            line = loop.group(3).replace(f"${loop.group(1)}", loop.group(2))
        words = shlex.split(line)
        if words[:1] == ["python"] and words[1].startswith("algos/"):
            out.append((words[1], words[2:]))
    return out


@pytest.mark.parametrize("number", sorted(LESSONS))
def test_a_lessons_experiment_commands_parse_with_the_scripts_flags(number):
    """Every training command of an experiment is accepted by its script's flag parser (tyro), as typed in the page."""
    import importlib

    import tyro

    argvs = _experiment_argvs(number)
    assert argvs, "an experiment trains something"
    for script, flags in argvs:
        module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
        args = module.cli(flags) if hasattr(module, "cli") else tyro.cli(module.Args, args=flags)
        assert args.run_dir and args.run_dir.startswith("runs/course/"), (script, flags)
