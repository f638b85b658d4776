"""Tests for core/embedded.py (the synthetic addition task and artifact builds) and rewards/arithmetic.py."""

import json
from pathlib import Path
import os

import pytest
import torch

from core import data, embedded
from core.config import ModelConfig
from rewards.arithmetic import parse_answer, reward_func


# ------------------------------------------------------------------------------------------------------------ task
def test_task_rows_deterministic_disjoint_and_correct():
    train, test = embedded.task_rows(2, seed=0)
    assert (train, test) == embedded.task_rows(2, seed=0)
    assert embedded.task_rows(2, seed=1)[1] != test
    assert len(test) == embedded.TEST_SIZE == 500 and len(train) + len(test) == 100 * 100  # every 2-digit pair
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train[:200] + test:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert len(a) == len(b) == 2 and len(r["answer"]) == 3, r  # fixed width: zero-padded operands and sum
        assert int(r["answer"]) == int(a) + int(b) and r["datasource"] == "add2"


def test_task_rows_small_task_keeps_training_rows():
    train, test = embedded.task_rows(1)
    assert (len(train), len(test)) == (80, 20)


def test_task_rows_large_digit_counts_are_sampled():
    train, test = embedded.task_rows(4, seed=0)
    assert len(test) == 500 and len(train) == 20_000 - 500
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    assert embedded.task_rows(4, seed=0)[1] == test


def test_resolve_data_builds_the_task_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path / "home"))
    folder = embedded.resolve_data("cleanrlhf/add2")
    assert folder == str(tmp_path / "home" / "data" / "add2")
    train, test = embedded.task_rows(2)
    for name, rows in [("train.jsonl", train), ("test.jsonl", test)]:
        lines = (tmp_path / "home" / "data" / "add2" / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows
    # built once: a second call reuses it
    stamp = (tmp_path / "home" / "data" / "add2" / "train.jsonl").stat().st_mtime_ns
    assert embedded.resolve_data("cleanrlhf/add2") == folder
    assert (tmp_path / "home" / "data" / "add2" / "train.jsonl").stat().st_mtime_ns == stamp
    # and the data loader sees the splits
    (src,) = data.load_sources("cleanrlhf/add2", "test")
    assert src.name.endswith("add2/test.jsonl") and len(src.rows) == 500


def test_an_empty_home_variable_means_the_default_cache_not_the_working_folder(monkeypatch):
    """`CLEANRLHF_HOME=` (set, empty: how `export CLEANRLHF_HOME=` reads) is the default ~/.cache/cleanrlhf; as a
    path it would have been the current folder, and builds would have landed in whatever folder a run started in."""
    monkeypatch.setenv("CLEANRLHF_HOME", "")
    assert embedded.home() == embedded.Path.home() / ".cache" / "cleanrlhf"
    monkeypatch.setenv("CLEANRLHF_HOME", "/somewhere")
    assert str(embedded.home()) == "/somewhere"


def test_artifact_from_another_build_version_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path))
    folder = embedded.ensure_task_data("add1")
    (folder / ".complete").write_text("")  # as written by an older build
    (folder / "train.jsonl").write_text("stale\n")
    assert embedded.ensure_task_data("add1") == folder
    assert (folder / "train.jsonl").read_text().splitlines()[0].startswith("{")
    assert (folder / ".complete").read_text() == embedded.ARTIFACT_VERSION


def test_the_suite_runs_with_the_reproducible_cpu_math():
    """conftest.py pins ATen/MKL/oneDNN to AVX2 before torch loads: the learning thresholds hold on any x86-64 CPU."""
    pin = embedded.reproducible_cpu_env()
    if not pin:
        pytest.skip("not an x86-64 machine with AVX2: nothing to pin")
    assert {k: os.environ.get(k) for k in pin} == pin
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"


@pytest.mark.parametrize("name", ["cleanrlhf/foo", "cleanrlhf/add0", "cleanrlhf/add10", "cleanrlhf/add"])
def test_unknown_embedded_dataset(tmp_path, monkeypatch, name):
    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="unknown embedded dataset"):
        embedded.resolve_data(name)
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_resolve_passes_other_names_through(tmp_path, monkeypatch, tiny_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cleanrlhf" / "add2").mkdir(parents=True)  # a local folder shadows the embedded name
    assert embedded.resolve_data("cleanrlhf/add2") == "cleanrlhf/add2"
    assert embedded.resolve_data("my.jsonl") == "my.jsonl"
    assert embedded.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert embedded.resolve_model("cleanrlhf/tiny") == str(tiny_path)
    assert (tiny_path / "config.json").exists() and (tiny_path / "tokenizer.json").exists()


# ---------------------------------------------------------------------------------------------------------- reward
def test_reward_hand_cases():
    cases = [  # (response, label, reward, format_ok)
        ("46", "46", 1.0, 1.0),  # correct
        ("47", "46", 0.0, 1.0),  # wrong number
        ("4", "46", 0.0, 1.0),  # a prefix of the answer is wrong
        ("466", "46", 0.0, 1.0),  # so is an extension
        ("abc", "46", 0.0, 0.0),  # garbage
        ("", "46", 0.0, 0.0),  # nothing
        ("46 because 40+6", "46", 1.0, 1.0),  # trailing text after the number is ignored
        ("46</s>", "46", 1.0, 1.0),
        (" 46\n", "46", 1.0, 1.0),  # surrounding whitespace
        ("the answer is 46", "46", 0.0, 0.0),  # the number must come first
        ("-3", "-3", 1.0, 1.0),
        ("3", " 3 ", 1.0, 1.0),  # label whitespace
        ("108", 108, 1.0, 1.0),  # integer labels
    ]
    prompts = [f"{i}+1=" for i in range(len(cases))]
    out = reward_func([p + c[0] for p, c in zip(prompts, cases)], prompts, [c[1] for c in cases])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"].dtype == torch.float32 and out["rewards"].shape == (len(cases),)
    assert out["rewards"].tolist() == [c[2] for c in cases]
    assert out["scores"].tolist() == [c[2] for c in cases]
    assert out["extra_logs"]["format_ok"].tolist() == [c[3] for c in cases]


def test_reward_query_that_does_not_start_with_prompt_is_all_response():
    assert reward_func(["46"], ["12+34="], ["46"])["rewards"].tolist() == [1.0]
    assert parse_answer("  -12x") == "-12" and parse_answer("x12") is None


def test_reward_length_mismatch():
    with pytest.raises(ValueError, match="2 queries, 1 prompts, 2 labels"):
        reward_func(["1+1=2", "1+2=3"], ["1+1="], ["2", "3"])


def test_a_build_started_from_a_torchrun_rank_gets_a_world_of_its_own(monkeypatch):
    """The warm-start build runs `algos/sft.py` as a child: started from a torchrun rank it must not see the rank's
    launcher variables, or its rendezvous waits for torchrun's agent store forever (TORCHELASTIC_USE_AGENT_STORE)."""
    launcher = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    for k, v in launcher.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CLEANRLHF_UNRELATED", "kept")
    env = embedded.standalone_env()
    assert not set(launcher) & set(env), set(launcher) & set(env)
    assert env["CLEANRLHF_UNRELATED"] == "kept"


@pytest.mark.parametrize("name", ["cleanrlhf/tiny", "cleanrlhf/tiny-moe"])
def test_a_build_by_a_rank_other_than_0_writes_the_weights(tmp_path, monkeypatch, name):
    """Two SLURM nodes share one cache and rank 1 takes the build lock first: transformers 5 writes a model's weights
    only on rank 0 of an initialized process group, so the build left the tokenizer, no weights, and the `.complete`
    marker (every later test of that cache failed on 'no config.json'). The build writes them whatever the rank."""
    from transformers.distributed import mixin

    from core import models

    monkeypatch.setenv("CLEANRLHF_HOME", str(tmp_path))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    folder = Path(embedded.resolve_model(name))
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors")), sorted(folder.iterdir())
    assert models.load_causal_lm(ModelConfig(name_or_path=str(folder))).num_parameters() > 0
