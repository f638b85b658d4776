"""The run report (core/report.py): a self-contained page from a run folder, tolerant of what a killed or old run
leaves, and a browser test that looks at it as a person would (headless Chromium driven by selenium)."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from core import report

STEPS, PER_STEP = (1, 2), 8  # samples.jsonl: 2 steps x 8 train samples (2 prompt groups of 4), plus 3 eval rows


def _sample(step: int, index: int, rng: random.Random) -> dict:
    n = rng.randint(4, 9)
    engine = [-rng.random() * 3 for _ in range(n)]
    kept = index % 4 != 3
    tokens = {"text": [f" w{i}" if i % 5 else "<b>" for i in range(n)], "engine_logp": engine, "trained": [kept] * n}
    if kept:  # the trainer's view: only on rows the update trained on (value: a critic's, not computed here)
        tokens.update(trainer_logp=[e + rng.gauss(0, 0.05) for e in engine], advantage=[(index % 4 - 1.5) / 1.5] * n,
                      ratio=[rng.uniform(0.7, 1.4) for _ in engine], entropy=[rng.random() for _ in engine],
                      kl=[rng.gauss(0, 0.02) for _ in engine], value=[None] * n)  # fmt: skip
    return {"step": step, "kind": "train", "index": index, "group": index // 4, "prompt": f"What is {index} + {step}?",
            "response": "".join(tokens["text"]), "reward": float(index % 2), "extra": {"format": 1.0},
            "advantage": tokens.get("advantage", [None])[0], "kept": kept, "truncated": index == 5, "length": n,
            "tokens": tokens}  # fmt: skip


@pytest.fixture
def run_dir(tmp_path):
    """A synthetic GRPO-like run folder: 4 steps of metrics, config.json, summary.json, samples.jsonl (2 steps of 8
    train samples with token arrays, one of them holding text that would end a <script> tag, and 3 eval rows)."""
    rng = random.Random(0)
    d = tmp_path / "run"
    d.mkdir()
    metrics = [{"step": s, "rollout/reward_mean": 0.1 * s, "loss/kl": 0.01 * s, "loss/entropy": 1.0 - 0.1 * s,
                "rollout/response_len_mean": 20.0 + s, "loss/clipfrac": 0.02, "train/grad_norm": 1.5,
                "perf/gen_s": 2.0, "perf/train_s": 3.0, "perf/sync_s": 0.5, "loss/policy": -0.01, "train/lr": 1e-6}
               for s in range(1, 5)]  # fmt: skip
    for m in metrics[1::2]:
        m.update({"eval/pass@1": 0.1 * m["step"], "eval/pass@4": 0.2 * m["step"]})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "config.json").write_text(json.dumps({"exp_name": "grpo", "train": {"max_steps": 4, "lr": 1e-6}}))
    (d / "summary.json").write_text(json.dumps({"wall_s": 12.5, "reward_mean_last": 0.4}))
    samples = [_sample(s, i, rng) for s in STEPS for i in range(PER_STEP)]
    samples[0]["response"] = "</script><script>alert(1)</script>"
    samples += [{"step": 2, "kind": "eval", "index": i, "prompt": "1+1?", "response": "2", "reward": float(i != 1),
                 "correct": i != 1, "label": "2", "tokens": {"text": ["2"], "engine_logp": [-0.1], "trained": [0]}}
                for i in range(3)]  # fmt: skip
    (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return d


class _Tags(HTMLParser):
    """Every tag's attributes of a page (script and style bodies are text to HTMLParser, so the URLs inside
    plotly.js's code do not count)."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', html, re.S)
    assert m, "no embedded samples JSON"
    return json.loads(m.group(1))


def test_report_is_self_contained(run_dir):
    out = report.write_report(run_dir)
    assert out == run_dir / "report.html" and out.is_file()
    html = out.read_text()
    assert "<script src" not in html
    parser = _Tags()
    parser.feed(html)
    external = [(t, a) for t, a in parser.tags for k in ("src", "href") if re.match(r"\s*(https?:)?//", a.get(k) or "")]
    assert not external, external
    assert [t for t, _ in parser.tags if t == "link"] == []
    assert len(re.findall(r"\* plotly\.js v\d", html)) == 1, "plotly.js must be inline exactly once"
    data = _embedded(html)
    assert len(data["samples"]) == len(STEPS) * PER_STEP + 3
    assert data["samples"][0]["response"] == "</script><script>alert(1)</script>"
    assert "alert(1)</script>" not in html  # the data's "<" is escaped: it cannot end its <script> tag
    assert set(data["quantities"]) == {"advantage", "ratio", "gap", "entropy", "kl", "engine_logp"}  # value: all null
    shown = html.replace("\\u002f", "/")  # plotly's JSON writes "/" as \u002f
    for name in ("rollout/reward_mean", "eval/pass@1", "loss/kl", "perf/sync_s", "loss/policy", "train.max_steps"):
        assert name in shown, name
    assert 'id="curves"' in html and 'id="colour-by"' in html and 'id="step-select"' in html


def test_no_samples_file(run_dir):
    (run_dir / "samples.jsonl").unlink()
    html = report.write_report(run_dir).read_text()
    assert "no samples.jsonl in this run (written by runs since" in html
    assert "reward_mean" in html and "samples-data" not in html


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_torn_last_line_is_skipped(run_dir, name):
    path = run_dir / name
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines) + lines[-1][: len(lines[-1]) // 2])  # a kill mid-write: half a line, no newline
    html = report.write_report(run_dir).read_text()
    assert f"{name}: 1 unreadable line skipped (line {len(lines) + 1}:" in html
    if name == "samples.jsonl":
        assert len(_embedded(html)["samples"]) == len(lines)
    else:
        assert f"{len(lines)} metric rows" in html and "reward_mean" in html


def test_empty_run_folder(tmp_path):
    html = report.write_report(tmp_path).read_text()
    for missing in ("no metrics.jsonl", "no config.json", "no summary.json", "no samples.jsonl"):
        assert missing in html, missing
    assert "<script src" not in html


def test_samples_missing_keys_and_nan(run_dir):
    """Rows with keys missing, null or NaN values, odd kinds and pairs: shown, never a crash; no NaN reaches JSON."""
    rows = [
        {"step": 3},
        {"kind": "pair", "step": 3, "prompt": "p", "chosen": "a", "margin": float("nan")},
        {"kind": "train", "step": 3, "tokens": {"text": ["a"], "ratio": [None]}},
        {"kind": "other", "reward": 1},
    ]
    with open(run_dir / "samples.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    html = report.write_report(run_dir).read_text()
    data = _embedded(html)  # json.loads of the page's data: strict JSON, as the browser's JSON.parse
    assert data["samples"][-3]["margin"] is None


def test_not_a_folder(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="is not a folder"):
        report.write_report(path)
    for bad in (path, tmp_path / "missing"):
        proc = subprocess.run([sys.executable, "-m", "core.report", str(bad)], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.dirname(report.__file__)))  # fmt: skip
        assert proc.returncode == 2, proc
        assert str(bad) in proc.stderr and "Traceback" not in proc.stderr


def test_cli_writes_report(run_dir):
    assert report.main([str(run_dir)]) == 0
    assert (run_dir / "report.html").is_file()


# ------------------------------------------------------------------------------------------------ in a browser
def _install_chromium() -> None:
    """apt-get install chromium and chromium-driver when missing (Debian, root); skip when that cannot be done."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the browser test needs chromium and chromium-driver: run as root on Debian (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def chromium(width: int = 1400, height: int = 1000):
    """Headless Chromium under selenium, with Debian's chromedriver (selenium never downloads a driver)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):  # no sandbox: as root
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)


def look_at(driver, html_path, png_path, step=None) -> None:
    """Open a report, wait until its curves are drawn, choose `step`, save a screenshot. docs/img/report.png is one:
    python -c "from tests.test_report import *; look_at(chromium(1400, 2000), Path('RUN/report.html'), 'x.png')"."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver.get(Path(html_path).resolve().as_uri())
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#curves .js-plotly-plot svg"))
    if step is not None:
        Select(driver.find_element(By.ID, "step-select")).select_by_value(str(step))
    driver.save_screenshot(str(png_path))


@pytest.fixture(scope="module")
def browser():
    _install_chromium()
    driver = chromium()
    yield driver
    driver.quit()


@pytest.mark.slow
def test_report_in_browser(run_dir, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    html = report.write_report(run_dir)
    look_at(browser, html, tmp_path / "report.png", step=STEPS[0])
    assert browser.find_elements(By.CSS_SELECTOR, "#curves .js-plotly-plot .main-svg")
    assert browser.execute_script("return document.querySelectorAll('#curves .js-plotly-plot').length") >= 8
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for step in (*STEPS, STEPS[0]):
        Select(browser.find_element(By.ID, "step-select")).select_by_value(str(step))
        shown = browser.find_elements(By.CSS_SELECTOR, "#samples .sample")
        assert len(shown) == sum(r["step"] == step for r in rows), step
    backgrounds = "return [...document.querySelectorAll('.tok')].map((t) => getComputedStyle(t).backgroundColor)"
    colour_by = Select(browser.find_element(By.ID, "colour-by"))
    assert colour_by.first_selected_option.get_attribute("value") == "advantage"
    by_advantage = browser.execute_script(backgrounds)
    colour_by.select_by_value("ratio")
    by_ratio = browser.execute_script(backgrounds)
    assert len(by_ratio) == len(by_advantage) > 0 and by_ratio != by_advantage
    assert len(set(by_ratio)) > 3, "ratios differ token by token: so must their colours"
    tok = browser.find_element(By.CSS_SELECTOR, ".sample .tok")
    assert "engine_logp" in tok.get_attribute("title")
    Select(browser.find_element(By.ID, "kept-select")).select_by_visible_text("no")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".sample")) == PER_STEP // 4  # index 3 and 7: filtered rows
    browser.save_screenshot(str(tmp_path / "report.png"))
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    logs = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not logs, logs


@pytest.mark.slow
def test_pairs_and_odd_rows_in_browser(run_dir, browser, tmp_path):
    """A dpo/rm run's preference pairs and rows with keys missing (no kind, no step, a token list of nulls): drawn,
    filtered by margin, and no script error."""
    from selenium.webdriver.common.by import By

    rows = [{"step": 5, "kind": "pair", "index": i, "prompt": f"q{i}", "chosen": "good", "rejected": "bad", "margin": m,
             "chosen_score": m, "rejected_score": 0.0} for i, m in enumerate((1.5, -0.5, 0.25))]  # fmt: skip
    rows += [{"step": 5}, {"step": 5, "kind": "train", "tokens": {"text": ["a", "b"], "ratio": [None, 2.0]}}]
    rows += [{"kind": "odd", "reward": 1}]
    with open(run_dir / "samples.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    look_at(browser, report.write_report(run_dir), tmp_path / "pairs.png", step=5)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".sample")) == 5
    assert len(browser.find_elements(By.CSS_SELECTOR, ".sample.kind-pair .chosen")) == 3
    assert "margin 1.5" in browser.find_element(By.CSS_SELECTOR, ".sample.kind-pair .meta").text
    browser.find_element(By.ID, "reward-min").send_keys("0")  # pairs by margin; rows without a value leave
    metas = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".sample .meta")]
    assert [m.split(" · ")[2] for m in metas] == ["margin 1.5", "margin 0.25"]
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
