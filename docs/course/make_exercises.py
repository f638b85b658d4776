"""Write the course's exercise files from the real sources: each is a copy of its lesson's file (lessons.py) with a
header saying what to do and the body of one function replaced by `raise NotImplementedError`. The signature, the
decorators and the docstring stay, so the exercise states what the function must return.

    python docs/course/make_exercises.py            # (re)write docs/course/exercises/*.py
    python docs/course/make_exercises.py --check    # exit 1 if a committed exercise differs from its source

Run it after changing a lesson's function in the real file; tests/test_course.py fails until the exercises match.
"""

from __future__ import annotations

import argparse
import ast
import sys

from lessons import LESSONS, REPO, Lesson


def body_lines(source: str, function: str) -> tuple[int, int, str]:
    """The 0-based [start, end) line range of `function`'s body after its docstring, and the body's indentation.
    The function must be defined at the top level of `source`, with a docstring and at least one statement."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            body = node.body
            if not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)) or len(body) < 2:
                raise ValueError(f"{function}: needs a docstring followed by code")
            first = body[1]
            line = source.splitlines()[first.lineno - 1]
            return first.lineno - 1, node.end_lineno, line[: len(line) - len(line.lstrip())]
    raise ValueError(f"no top-level function {function!r}")


def header(lesson: Lesson) -> list[str]:
    target = f"runs inside {lesson.runs}" if lesson.runs else "runs as the file it copies"
    return [
        f"# Course exercise, lesson {lesson.number}: {lesson.title} (docs/course/{lesson.page.name}).",
        f"# A copy of {lesson.source} with the body of `{lesson.function}` left for you to write; the rest is the",
        f"# real code and {target}. Check your function, then a short learning run with it:",
        f"#     python docs/course/check.py {lesson.number} <this file>",
        "# Written by docs/course/make_exercises.py from the real file; edit your own copy, not this one.",
    ]


def render(lesson: Lesson) -> str:
    """The exercise file's text for `lesson`."""
    source = (REPO / lesson.source).read_text()
    start, end, indent = body_lines(source, lesson.function)
    lines = source.splitlines()
    blank = [
        f"{indent}# YOUR CODE HERE: the docstring above says what to return (lesson {lesson.number}).",
        f'{indent}raise NotImplementedError("lesson {lesson.number}: write {lesson.function}")',
    ]
    return "\n".join([*header(lesson), *lines[:start], *blank, *lines[end:]]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    opts = ap.parse_args()
    stale = []
    for lesson in LESSONS.values():
        if lesson.exercise is None:
            continue
        text = render(lesson)
        if opts.check:
            if not lesson.exercise.is_file() or lesson.exercise.read_text() != text:
                stale.append(lesson.exercise)
        else:
            lesson.exercise.parent.mkdir(parents=True, exist_ok=True)
            lesson.exercise.write_text(text)
            print(f"wrote {lesson.exercise.relative_to(REPO)}")
    for path in stale:
        print(f"{path.relative_to(REPO)} differs from its source: run python docs/course/make_exercises.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
