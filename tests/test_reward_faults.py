"""Faults in python reward functions (rewards/loader.py): what `score` accepts as "one number per query" and how it
rejects everything else with a message naming the file and the batch, and `--reward.timeout-s` on a function that
never returns."""

import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from rewards.loader import RewardConfig, load_reward_func, score

QUERIES, PROMPTS, LABELS = ["1+1=2", "1+2=4", "2+2=4"], ["1+1=", "1+2=", "2+2="], ["2", "3", "4"]
ROOT = Path(__file__).resolve().parents[1]


def reward_file(tmp_path, body: str, name: str = "my_reward.py") -> str:
    """A --reward.func file whose reward_func runs `body` (indented into the function; `n` = number of queries)."""
    path = tmp_path / name
    path.write_text("import time\n\nimport numpy as np\nimport torch\n\n\ndef reward_func(queries, prompts, labels):\n"
                    "    n = len(queries)\n" + textwrap.indent(textwrap.dedent(body), "    "))  # fmt: skip
    return str(path)


def run_score(path: str, step: int = 3, **cfg):
    fn, src = load_reward_func(RewardConfig(func=path, **cfg))
    return score(fn, src, QUERIES, PROMPTS, LABELS, step=step)


BAD_RESULTS = {
    "strings": "return ['1.0'] * n",
    "one string": "return '1.0'",
    "None": "return None",
    "a None inside": "return [1.0, None, 0.0]",
    "nested list": "return [[1.0] for _ in range(n)]",
    "nested list, flat count": "return [[1.0, 0.0], [1.0]]",  # 3 numbers in all for 3 queries
    "(N, 1) tensor": "return torch.ones(n, 1)",
    "(N, 2) tensor": "return torch.ones(n, 2)",
    "(N, 1) numpy array": "return np.ones((n, 1))",
    "0-d tensor": "return torch.tensor(1.0)",
    "complex tensor": "return torch.ones(n, dtype=torch.complex64)",
    "a dict": "return {i: 1.0 for i in range(n)}",
    "dict: rewards strings": "return {'rewards': ['1'] * n}",
    "dict: rewards None": "return {'rewards': None}",
    "dict: rewards (N, 1)": "return {'rewards': torch.zeros(n, 1)}",
    "dict: rewards nested": "return {'rewards': [[0.0]] * n}",
    "dict: scores strings": "return {'rewards': [1.0] * n, 'scores': ['x'] * n}",
    "dict: scores (N, 1)": "return {'rewards': [1.0] * n, 'scores': torch.zeros(n, 1)}",
    "dict: scores nested": "return {'rewards': [1.0] * n, 'scores': [[0.0]] * n}",
}


@pytest.mark.parametrize("body", BAD_RESULTS.values(), ids=BAD_RESULTS.keys())
def test_a_result_that_is_not_one_number_per_query_is_a_clear_error(tmp_path, body):
    with pytest.raises(ValueError, match=r"^reward function \S*my_reward\.py returned .+ on batch 3: expected one "
                                         r"number per query \(3 queries\)"):  # fmt: skip
        run_score(reward_file(tmp_path, body))


@pytest.mark.parametrize(
    "body,needle",
    [
        ("return [1.0, 'x', 0.0]", r"rewards\[1\] = 'x' of type str"),
        ("return {'rewards': [1.0] * n, 'scores': [0.0, 0.0, None]}", r"scores\[2\] = 'None' of type NoneType"),
        ("return torch.zeros(n, 2)", r"rewards of shape \(3, 2\)"),
        ("return {'rewards': [1.0] * n, 'scores': torch.zeros(n, 1)}", r"scores of shape \(3, 1\)"),
        ("return {'score': [1.0] * n}", r"a dict without 'rewards' \(keys \['score'\]\) on batch 3"),
        ("return {'rewards': [1.0] * n, 'scores': [0.0, float('nan'), 1.0]}", r"\(scores of queries \[1\]\)"),
    ],
)
def test_the_message_names_what_is_wrong(tmp_path, body, needle):
    with pytest.raises(ValueError, match=needle):
        run_score(reward_file(tmp_path, body))


GOOD_RESULTS = {
    "floats": "return [1.0, 0.0, 1.0]",
    "tuple of ints": "return (1, 0, 1)",
    "booleans": "return [q.endswith(l) for q, l in zip(queries, labels)]",
    "bool tensor": "return torch.tensor([True, False, True])",
    "numpy floats": "return np.array([1.0, 0.0, 1.0])",
    "numpy scalars": "return list(np.array([1.0, 0.0, 1.0], dtype=np.float32))",
    "0-d tensors": "return [torch.tensor(x) for x in (1.0, 0.0, 1.0)]",
    "dict with scores": "return {'rewards': torch.tensor([1.0, 0.0, 1.0]), 'scores': [1, 0, 1]}",
    "int64 tensor": "return torch.tensor([1, 0, 1])",
}


@pytest.mark.parametrize("body", GOOD_RESULTS.values(), ids=GOOD_RESULTS.keys())
def test_numbers_in_any_common_form_are_accepted(tmp_path, body):
    rewards, logs, scores, _ = run_score(reward_file(tmp_path, body))
    assert rewards.dtype == scores.dtype == torch.float32
    assert rewards.tolist() == scores.tolist() == [1.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------------ --reward.timeout-s
HANG = "time.sleep(3600)\nreturn [0.0] * n"


def test_a_reward_function_that_never_returns_times_out_naming_file_batch_and_flag(tmp_path):
    path = reward_file(tmp_path, HANG, name="hang_reward.py")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"reward function \S*hang_reward\.py did not return within 0\.5 s "
                                         r"\(--reward\.timeout-s\) on batch 4"):  # fmt: skip
        run_score(path, step=4, timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_the_timeout_leaves_results_and_errors_as_they_were(tmp_path):
    fn, src = load_reward_func(RewardConfig(timeout_s=5))  # the embedded rule, timed
    rewards, logs, _, _ = score(fn, src, QUERIES, PROMPTS, LABELS, step=0)
    assert rewards.tolist() == [1.0, 0.0, 1.0] and logs["rollout/format_ok"] == 1.0
    path = reward_file(tmp_path, "raise KeyError('label')", name="raising_reward.py")
    with pytest.raises(ValueError, match=r"raising_reward\.py raised on batch 2: KeyError: 'label'"):
        run_score(path, step=2, timeout_s=5)
    path = reward_file(tmp_path, "return [float(torch.is_grad_enabled())] * n", name="grad_reward.py")
    with torch.no_grad():  # the caller's grad mode reaches the thread
        assert run_score(path, timeout_s=5)[0].tolist() == [0.0] * 3
    assert run_score(path, timeout_s=5)[0].tolist() == [1.0] * 3


def test_timeout_zero_calls_the_function_in_this_thread(tmp_path):
    path = reward_file(tmp_path, "import threading\nreturn [float(threading.current_thread() is "
                                 "threading.main_thread())] * n")  # fmt: skip
    assert threading.current_thread() is threading.main_thread()
    assert run_score(path, timeout_s=0)[0].tolist() == [1.0] * 3
    assert run_score(path, timeout_s=5)[0].tolist() == [0.0] * 3
    with pytest.raises(ValueError, match=r"--reward.timeout-s -1.0: must be >= 0"):
        run_score(path, timeout_s=-1.0)


def test_a_timed_out_reward_thread_does_not_keep_the_process_alive(tmp_path):
    """The hung call is left in a daemon thread: the script's error ends the process at once."""
    path = reward_file(tmp_path, HANG, name="hang_reward.py")
    code = ("import sys\nfrom rewards.loader import RewardConfig, load_reward_func, score\n"
            f"fn, src = load_reward_func(RewardConfig(func={path!r}, timeout_s=0.3))\n"
            "try:\n    score(fn, src, ['a'], ['a'], ['1'], step=1)\nexcept ValueError as e:\n    print(e)\n"
            "    sys.exit(3)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "hang_reward.py did not return within 0.3 s (--reward.timeout-s) on batch 1" in proc.stdout


def test_an_eval_call_is_named_as_such_and_a_nan_extra_log_warns_once(tmp_path):
    """A reward error during an eval (the executor's step −1) says "an eval", not "batch -1"; a NaN inside
    `extra_logs` is logged as nan with one warning naming the key, not silently."""
    def failing(queries, prompts, labels):
        raise KeyError("label")

    with pytest.raises(ValueError, match=r"raised on an eval \(its greedy pass@1 or sampled pass@k prompts\): KeyError"):
        score(failing, "my_reward.py", ["a"], ["a"], ["1"], step=-1)

    def nan_log(queries, prompts, labels):
        return {"rewards": [1.0] * len(queries), "extra_logs": {"acc": [float("nan")] * len(queries)}}

    with pytest.warns(UserWarning, match=r"extra_logs\['acc'\] holds NaN on batch 3"):
        _, logs, _, _ = score(nan_log, "nan_reward.py", ["a"], ["a"], ["1"], step=3)
    assert math.isnan(logs["rollout/acc"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: logged, no second warning
        score(nan_log, "nan_reward.py", ["a"], ["a"], ["1"], step=4)


def test_a_reward_file_that_does_not_import_is_named_with_its_line(tmp_path):
    """A syntax error ended on a bare `SyntaxError`; like an agent file's, it names the flag, file, line and column."""
    path = tmp_path / "broken_reward.py"
    path.write_text("import math\n\n\ndef reward_func(queries, prompts, labels)\n    return [1.0] * len(queries)\n")
    with pytest.raises(ValueError, match=rf"^--reward.func {path}, line 4, column \d+: expected ':': "
                                         r"'def reward_func\(queries, prompts, labels\)'$") as err:  # fmt: skip
        load_reward_func(RewardConfig(func=str(path)))
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one line, not a SyntaxError traceback
    path.write_text("import math\n\nSCALE = math.nope\n\n\ndef reward_func(queries, prompts, labels):\n    return 1\n")
    with pytest.raises(ValueError, match=rf"^--reward.func {path}, line 3: importing it raised AttributeError: .*nope"):
        load_reward_func(RewardConfig(func=str(path)))
