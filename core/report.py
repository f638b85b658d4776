"""The run report: `python -m core.report <run_dir>` writes `<run_dir>/report.html`, one file that opens from disk with
no network (plotly.js, the styles and the sample browser's script are inline), to see inside a run:

- the curves the house metric names promise (reward, pass@k, KL, entropy, response length, clip fraction, grad norm,
  the gen/train/sync time split; loss, accuracy and margin for sft/dpo/rm/kto), then every other numeric metric;
- the end-of-run summary (`summary.json`: absent while a run goes on or after a kill) and the flags (`config.json`);
- the sample browser over `samples.jsonl`: one step's rollout, eval answers or preference pairs at a time, filtered by
  reward, kept, truncated and correct, each response token coloured by its advantage, ratio, logp gap (engine −
  trainer before the step's first update), entropy, KL or log-prob, each card naming the minibatch the sample trained
  in. Only the chosen step is drawn, so a run with thousands of samples stays usable.

A run folder is read as it is: a line torn by a kill is skipped and counted, a missing file is named on the page. Only
a path that is not a folder is refused (ValueError naming it; exit code 2 from the command line).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

import jinja2
from markupsafe import Markup

from core.config import flat_keys

PANELS = (
    ("reward", ("rollout/reward_mean", "rollout/fresh_reward_mean")),
    ("eval pass@k", ("eval/pass@*",)),
    ("KL", ("loss/kl", "train/kl")),
    ("entropy", ("loss/entropy",)),
    ("response length (tokens)", ("rollout/response_len_mean",)),
    ("clip fraction", ("loss/clipfrac",)),
    ("grad norm", ("train/grad_norm",)),
    ("loss", ("loss/sft", "loss/dpo", "loss/rm", "loss/kto", "train/loss", "eval/loss")),
    ("accuracy", ("train/accuracy", "eval/accuracy", "train/reward_accuracy", "eval/pref_accuracy",
                  "eval/logp_accuracy")),
    ("margin", ("train/margin", "eval/margin", "train/reward_margin", "eval/logp_gap")),
    ("chosen / rejected reward", ("train/chosen_reward", "train/rejected_reward", "eval/chosen_reward",
                                  "eval/rejected_reward", "train/reward_desirable", "train/reward_undesirable")),
)  # fmt: skip
"""The curves shown first, as (title, metric names or fnmatch patterns); a panel none of whose metrics the run logged
is left out, so one list serves the RL scripts and the sft family alike."""
TIME_SPLIT = ("perf/gen_s", "perf/train_s", "perf/sync_s")
"""Where an RL step's wall time goes, drawn as one stacked bar per step."""
SAMPLES_SINCE = "2026-11-27 (core/samples.py)"
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "showSendToCloud": False,  # a private run stays on disk
               "modeBarButtonsToRemove": ["select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d"]}  # fmt: skip
TEMPLATE = "report.html.j2"


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """The JSON objects of a .jsonl file, and the numbers of the lines that are not one (a line torn by a kill while it
    was written, most often the last): those are skipped so that a killed run still gets its report. NaN and ±Infinity
    read as None (null): the browser's JSON.parse takes neither."""
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, parse_constant=lambda _: None)
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(number)
    return rows, bad


def _read_json(path: Path, notes: list[str], missing: str = "") -> dict | None:
    """A JSON file's object; None, with a note saying why (`missing` when the file is not there), when it cannot be
    read."""
    if not path.is_file():
        notes.append(missing or f"no {path.name} in this run")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="replace"), parse_constant=lambda _: None)
    except ValueError as e:
        notes.append(f"{path.name} is not valid JSON ({e}): not shown")
        return None
    return value if isinstance(value, dict) else {"(value)": value}


def _read_rows(path: Path, notes: list[str]) -> list[dict] | None:
    """`read_jsonl`'s rows, with a note naming the lines skipped; None when the file is not there."""
    if not path.is_file():
        return None
    rows, bad = read_jsonl(path)
    if bad:
        where = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        notes.append(f"{path.name}: {len(bad)} unreadable line{'s' * (len(bad) > 1)} skipped (line {where}: torn by a "
                     "kill mid-write, or not a JSON object)")  # fmt: skip
    return rows


def _shown(v) -> str:
    """A summary value as the page shows it: floats to 6 significant digits, strings as they are, the rest as JSON."""
    return f"{v:.6g}" if isinstance(v, float) else v if isinstance(v, str) else json.dumps(v)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if _number(r.get("step")) and _number(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


_TEMPLATE: dict = {}


def _template() -> dict:
    """plotly's `plotly_white` template as plain JSON, made once per process (as a graph object it cost ~0.03 s a
    figure to validate)."""
    if not _TEMPLATE:
        import plotly.io as pio

        _TEMPLATE.update(pio.templates["plotly_white"].to_plotly_json())
    return _TEMPLATE


def curve_figures(rows: list[dict]) -> tuple[list[dict], dict | None, int]:
    """The named panels (one per `PANELS` entry the run logged, then the time split), one figure of small multiples
    holding every other numeric metric (None when there is none) and how many metrics that is. Figures are plotly's
    JSON (`data` traces and a `layout`), written without building graph objects: a report of 7 figures took 0.46 s
    that way and 0.002 s this way, at the end of every run."""
    logged = sorted({k for r in rows for k, v in r.items() if k != "step" and _number(v)})
    used, figures = set(), []
    layout = dict(template=_template(), height=290, margin=dict(l=55, r=15, t=40, b=40),
                  xaxis=dict(title=dict(text="step")),
                  legend=dict(orientation="h", yanchor="top", y=-0.22, font=dict(size=10)))  # fmt: skip
    for title, patterns in PANELS:
        keys = [k for p in patterns for k in sorted(fnmatch.filter(logged, p)) if k not in used]
        if not keys:
            continue
        used.update(keys)
        traces = []
        for key in keys:
            xs, ys = _series(rows, key)
            sparse = key.startswith("eval/") or len(xs) < 40
            traces.append(dict(type="scatter", x=xs, y=ys, name=key, mode="lines+markers" if sparse else "lines"))
        figures.append(dict(data=traces, layout=dict(layout, title=dict(text=title))))
    if any(k in logged for k in TIME_SPLIT):
        keys = [k for k in TIME_SPLIT if k in logged]
        used.update(keys)
        bars = [dict(type="bar", x=_series(rows, k)[0], y=_series(rows, k)[1], name=k) for k in keys]
        figures.append(
            dict(data=bars, layout=dict(layout, title=dict(text="time split per step (s)"), barmode="stack"))
        )
    others = [k for k in logged if k not in used]
    if not others:
        return figures, None, 0
    # small multiples, 3 to a row, laid out as plotly's make_subplots does: cells of equal size on the page, spaced
    # 0.2/3 across and min(0.3/rows, 0.08) down, each with its own axes and its metric's name centred above it
    cols, n_rows = 3, math.ceil(len(others) / 3)
    gap_x, gap_y = 0.2 / cols, min(0.3 / n_rows, 0.08)
    width, height = (1 - gap_x * (cols - 1)) / cols, (1 - gap_y * (n_rows - 1)) / n_rows
    grid = dict(data=[], layout=dict(template=_template(), height=200 * n_rows + 60, showlegend=False,
                                     margin=dict(t=40, b=30), annotations=[]))  # fmt: skip
    for i, key in enumerate(others):
        n = "" if i == 0 else str(i + 1)
        left, top = (i % cols) * (width + gap_x), 1 - (i // cols) * (height + gap_y)
        grid["layout"][f"xaxis{n}"] = dict(domain=[left, left + width], anchor=f"y{n}")
        grid["layout"][f"yaxis{n}"] = dict(domain=[max(0.0, top - height), top], anchor=f"x{n}")
        xs, ys = _series(rows, key)
        grid["data"].append(dict(type="scatter", x=xs, y=ys, name=key, mode="lines+markers", marker=dict(size=3),
                                 xaxis=f"x{n}", yaxis=f"y{n}"))  # fmt: skip
        grid["layout"]["annotations"].append(dict(text=key, x=left + width / 2, y=top, xref="paper", yref="paper",
                                                  xanchor="center", yanchor="bottom", showarrow=False,
                                                  font=dict(size=11)))  # fmt: skip
    return figures, grid, len(others)


def token_quantities(samples: list[dict]) -> list[str]:
    """The colourings the samples' tokens support: a quantity is offered where at least one token has a value for
    it (the logp gap needs the engine's log-prob and the trainer's before the step's updates, or at the loss in
    rows written before that was kept)."""
    have = set()
    for s in samples:
        tokens = s.get("tokens")
        if isinstance(tokens, dict):
            have.update(k for k, v in tokens.items() if isinstance(v, list) and any(_number(x) for x in v))
    if "engine_logp" in have and have & {"old_logp", "trainer_logp"}:
        have.add("gap")
    return [q for q in ("advantage", "ratio", "gap", "entropy", "kl", "value", "engine_logp") if q in have]


def write_report(run_dir: str | Path) -> Path:
    """Write `<run_dir>/report.html` (replacing an older one in one move, so a viewer never sees half a page) and
    return its path. Raises ValueError when `run_dir` is not a folder."""
    import plotly.io as pio

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a folder"
        raise ValueError(f"{run_dir} {what}: give the run folder (the --run-dir of a run; it holds metrics.jsonl)")
    notes: list[str] = []
    rows = _read_rows(run_dir / "metrics.jsonl", notes)
    if not rows:
        notes.append("metrics.jsonl holds no metrics yet: no curves" if rows is not None else
                     "no metrics.jsonl in this run: no curves (not a run folder? no step logged yet?)")  # fmt: skip
    config = _read_json(run_dir / "config.json", notes)
    summary = _read_json(run_dir / "summary.json", notes, "no summary.json: the run is still going, or was killed")
    samples = _read_rows(run_dir / "samples.jsonl", notes)
    missing_samples = None if samples else "samples.jsonl holds no samples yet"
    if samples is None:
        missing_samples = f"no samples.jsonl in this run (written by runs since {SAMPLES_SINCE})"
        notes.append(missing_samples)

    rows, samples = rows or [], samples or []
    panels, grid, n_others = curve_figures(rows)
    figures = [*panels, grid] if grid is not None else panels
    html = [
        Markup(pio.to_html(fig, full_html=False, include_plotlyjs=i == 0, config=PLOT_CONFIG, validate=False))
        for i, fig in enumerate(figures)
    ]  # plotly.js once; the figures are plain JSON (curve_figures)
    payload = {"samples": samples, "quantities": token_quantities(samples)}
    # "<" as \u003c: no text in a prompt or response can close the <script> tag that carries the data
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True)
    page = env.get_template(TEMPLATE).render(
        title=run_dir.resolve().name, run_dir=str(run_dir.resolve()), written=time.strftime("%Y-%m-%d %H:%M:%S"),
        notes=notes, n_rows=len(rows), panels=html[: len(panels)], others=html[len(panels) :], n_others=n_others,
        summary={k: _shown(v) for k, v in (summary or {}).items()}, config=flat_keys(config or {}),
        samples_json=Markup(data), missing_samples=missing_samples,
    )  # fmt: skip
    out = run_dir / "report.html"
    # a temporary name of this call's own: two writers at once (the run's end and `python -m core.report`, or two
    # such commands) each move a whole page into place, and the last one's stays
    tmp = run_dir / f".report.html.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder (a run's --run-dir)")
    args = parser.parse_args(argv)
    try:
        out = write_report(args.run_dir)
    except ValueError as e:
        print(f"core.report: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a read-only run folder
        print(f"core.report: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
