"""Run a lesson's experiment exactly as its page writes it (the indented commands under "## The experiment"), from
the repository root, and print how long it took:

    python docs/course/run_experiment.py 4          # -> runs/course/04_beta*, runs/course/04.png

The commands train into `runs/course/` and end with docs/course/plot.py drawing the lesson's plot.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from lessons import LESSONS, REPO


def commands(page: str) -> str:
    """The shell text of the indented block under "## The experiment" (continuation lines kept)."""
    section = page.split("## The experiment", 1)[1].split("\n## ", 1)[0]
    lines, started = [], False
    for line in section.splitlines():
        if line.startswith("    "):
            lines.append(line[4:])
            started = True
        elif started and line.strip():
            break
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lesson", type=int, choices=sorted(LESSONS))
    opts = ap.parse_args()
    text = commands(LESSONS[opts.lesson].page.read_text())
    text = re.sub(r"^python ", f"{sys.executable} ", text, flags=re.M)
    text = re.sub(r"; do python ", f"; do {sys.executable} ", text)
    print(text, flush=True)
    start = time.time()
    rc = subprocess.run(["bash", "-e", "-c", text], cwd=REPO).returncode
    print(f"lesson {opts.lesson}'s experiment: {time.time() - start:.0f} s, exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
