"""Tests for input and flag validation: rows longer than the model's context (core/data.py against
`models.max_positions`), labels that are not text, the generic flag rules of `core.config.check_args` and each
script's cross-field checks (all before anything is loaded), and model-path errors that name the flag as typed."""

import importlib
import json
import math
import re
from dataclasses import dataclass, field
from functools import partial

import pytest

from core import data, models
from core.config import (
    DataConfig,
    Fraction,
    ModelConfig,
    NonNegInt,
    OpenInterval,
    PosInt,
    WeightBounds,
    check_args,
    field_rules,
    flag_name,
)
from rewards.arithmetic import reward_func

SCRIPTS = ["sft", "dpo", "kto", "rm", "grpo", "grpo_async", "rloo", "reinforce_pp", "ppo"]
RL = {"grpo", "grpo_async", "rloo", "reinforce_pp", "ppo"}
TINY_CONTEXT = 512  # max_position_embeddings of the embedded tiny model (core/embedded.py)


def script(name):
    return importlib.import_module(f"algos.{name}")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def one_process(monkeypatch):
    """A world of one without torch.distributed (no DeepSpeed import): for checks that come before any collective."""
    import torch

    from core import engine

    monkeypatch.setattr(engine, "init_distributed", lambda *_, **__: (0, 1, torch.device("cpu")))


# ------------------------------------------------------------------------------------------- the model's context
def test_max_positions_reads_the_models_config(tiny_path):
    assert models.max_positions(str(tiny_path)) == TINY_CONTEXT
    assert models.max_positions("cleanrlhf/tiny") == TINY_CONTEXT  # embedded names resolve as the loaders do


def test_max_positions_names_the_flag_of_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match=r"^--actor\.model\.name-or-path '.*missing': no such model folder"):
        models.max_positions(str(tmp_path / "missing"), "--actor.model.name-or-path")


def test_data_max_len_defaults_to_the_model_limit_and_may_not_exceed_it():
    assert DataConfig().max_len is None
    limits = {"max_position_embeddings of --model.name-or-path": TINY_CONTEXT}
    assert data.resolve_max_len(None, limits) == TINY_CONTEXT
    assert data.resolve_max_len(100, limits) == 100
    with pytest.raises(ValueError, match=r"--data\.max-len 2048 exceeds the max_position_embeddings .*, 512"):
        data.resolve_max_len(2048, limits)
    # the smallest known limit wins (vLLM's --vllm.max-model-len below the model's context)
    assert data.resolve_max_len(None, {**limits, "--vllm.max-model-len": 300, "unknown": None}) == 300
    with pytest.raises(ValueError, match=r"set --data\.max-len"):
        data.resolve_max_len(None, {"max_position_embeddings of --model.name-or-path": None})


def test_a_response_budget_leaving_no_room_for_a_prompt_is_an_error():
    limits = {"max_position_embeddings of --actor.model.name-or-path": TINY_CONTEXT}
    assert data.resolve_max_len(None, limits, 511, "--rollout.max-new-tokens") == TINY_CONTEXT
    with pytest.raises(ValueError, match=r"^--rollout\.max-new-tokens 512 leaves no room for a prompt within 512"):
        data.resolve_max_len(None, limits, 512, "--rollout.max-new-tokens")


def test_sft_rows_longer_than_the_model_context_are_skipped_and_counted(tmp_path, tokenizer, tiny_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1" * 600 + "+1=", "answer": "2"},
            {"prompt": "1" * 700 + "+1=", "answer": "2"}, {"prompt": "10+20=", "answer": "30"}]  # fmt: skip
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig()  # --data.max-len not given: the model's limit
    cfg.max_len = data.resolve_max_len(cfg.max_len, {"max_position_embeddings": models.max_positions(str(tiny_path))})
    logs = []
    make = partial(data.sft_example, tokenizer=tokenizer, cfg=cfg)
    (examples,) = data.build_examples(data.load_sources(str(f), "train"), make, cfg, logs.append)
    assert len(examples) == 2 and all(len(ex["input_ids"]) <= TINY_CONTEXT for ex in examples)
    assert "skipped 2 of 4 rows" in logs[0] and "row 1" in logs[0]
    assert "{'longer than 512 tokens': 2}" in logs[0]  # one count for every length past the limit


@pytest.mark.parametrize("maker", ["preference_example", "reward_pair_example"])
def test_pairs_longer_than_the_context_are_bad_rows(tokenizer, maker):
    cfg = DataConfig(max_len=TINY_CONTEXT)
    row = {"prompt": "1+2=", "chosen": "3", "rejected": "4" * 600}
    with pytest.raises(data.BadRow, match="> --data.max-len 512"):
        getattr(data, maker)(row, tokenizer, cfg)


def test_rl_prompt_without_room_for_the_response_is_skipped_and_counted(tmp_path, tokenizer, tiny_path):
    """The RL limit: prompt + --rollout.max-new-tokens must fit the model's context (a 500-token prompt fits alone)."""
    max_new_tokens = 16
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1" * 499 + "=", "answer": "1"},
            {"prompt": "1" * 490 + "=", "answer": "1"}]  # fmt: skip
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig()
    limits = {"max_position_embeddings": models.max_positions(str(tiny_path))}
    cfg.max_len = data.resolve_max_len(cfg.max_len, limits, max_new_tokens, "--rollout.max-new-tokens")
    logs = []
    make = partial(data.prompt_example, tokenizer=tokenizer, cfg=cfg, reserve=max_new_tokens)
    (prompts,) = data.build_examples(data.load_sources(str(f), "train"), make, cfg, logs.append)
    assert [len(p["prompt_ids"]) for p in prompts] == [5, 492]  # <s> + text; 492 + 16 <= 512 fits
    assert "skipped 1 of 3 rows" in logs[0] and "row 1" in logs[0] and "501 prompt tokens + 16 response" in logs[0]


def test_rl_script_refuses_a_response_budget_as_long_as_the_context(tiny_path, monkeypatch, one_process):
    grpo = script("grpo")
    monkeypatch.setattr(models, "load_tokenizer", lambda *_, **__: pytest.fail("loaded past the limit check"))
    args = grpo.Args()
    args.actor.model.name_or_path = str(tiny_path)
    args.rollout.max_new_tokens = TINY_CONTEXT
    with pytest.raises(ValueError, match=r"--rollout\.max-new-tokens 512 leaves no room"):
        grpo.main(args)
    args = grpo.Args()  # multi-turn: the feedback budget counts too
    args.actor.model.name_or_path = str(tiny_path)
    args.rollout.env_file, args.rollout.max_total_tokens = "agents/retry_env.py", 600
    with pytest.raises(ValueError, match=r"--rollout\.max-new-tokens \+ --rollout\.max-total-tokens 608 leaves"):
        grpo.main(args)


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_explicit_max_len_above_the_context_fails_before_loading_weights(name, tiny_path, monkeypatch,
                                                                          one_process):  # fmt: skip
    module = script(name)
    monkeypatch.setattr(models, "load_causal_lm", lambda *_, **__: pytest.fail("weights loaded"))
    args = module.Args()
    (args.model if name == "sft" else args.actor.model).name_or_path = str(tiny_path)
    args.data.max_len = 4096
    with pytest.raises(ValueError, match=r"--data\.max-len 4096 exceeds the max_position_embeddings .*, 512"):
        module.main(args)


# ------------------------------------------------------------------------------------------------------- labels
def test_json_number_labels_become_text(tokenizer):
    cfg = DataConfig(max_len=TINY_CONTEXT)
    label = lambda value: data.prompt_example({"prompt": "1+1=", "answer": value}, tokenizer, cfg)["label"]  # noqa: E731
    assert label(42) == "42" and label(42.0) == "42" and label(2.5) == "2.5" and label(0) == "0"
    assert label("042") == "042"
    assert label(True) is True and label([1, 2]) == [1, 2] and label({"x": 1}) == {"x": 1}  # passed through


def test_integer_labels_of_a_mixed_json_column_still_earn_their_reward(tmp_path, tokenizer):
    """JSON ints beside floats load as 42.0 (one float64 column); the arithmetic reward must still match "42"."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "40+2=", "answer": 42}, {"prompt": "5/2=", "answer": 2.5}])
    cfg = DataConfig(max_len=TINY_CONTEXT)
    make = partial(data.prompt_example, tokenizer=tokenizer, cfg=cfg)
    (prompts,) = data.build_examples(data.load_sources(str(f), "train"), make, cfg)
    assert [p["label"] for p in prompts] == ["42", "2.5"]
    out = reward_func([prompts[0]["prompt"] + "42"], [prompts[0]["prompt"]], [prompts[0]["label"]])
    assert out["rewards"].tolist() == [1.0]


@pytest.mark.parametrize("response, label, reward", [
    ("063", 63, 1.0), ("63", "063", 1.0), ("063", "63", 1.0), ("0063 and more", "+63", 1.0), ("-05", "-5", 1.0),
    ("-0", "0", 1.0), ("064", "063", 0.0), ("-63", "63", 0.0), ("no number", "063", 0.0), ("2", "2.5", 0.0),
    ("1" * 5000, "0" + "1" * 5000, 1.0),  # beyond int()'s 4300 digits: compared as text without leading zeros
])  # fmt: skip
def test_arithmetic_answers_compare_as_numbers(response, label, reward):
    assert reward_func(["1+2=" + response], ["1+2="], [label])["rewards"].tolist() == [reward]


def test_integer_answers_in_a_file_of_zero_padded_text_answers_earn_their_reward(tmp_path, tokenizer):
    """The task's answers are zero-padded ("063"); a file holding some as JSON numbers (63) gives a column that
    `datasets` reads as one type (it turns "003" into 3): whatever the loader makes of the column, the response in the
    task's format earns its reward."""
    rows = [
        {"prompt": "60+03=", "answer": 63},
        {"prompt": "01+02=", "answer": "003"},
        {"prompt": "10+10=", "answer": "020"},
    ]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(max_len=TINY_CONTEXT)
    make = partial(data.prompt_example, tokenizer=tokenizer, cfg=cfg)
    (prompts,) = data.build_examples(data.load_sources(str(f), "train"), make, cfg)
    responses = ["063", "003", "020"]
    out = reward_func([p["prompt"] + r for p, r in zip(prompts, responses)], [p["prompt"] for p in prompts],
                      [p["label"] for p in prompts])  # fmt: skip
    assert out["rewards"].tolist() == [1.0, 1.0, 1.0], [p["label"] for p in prompts]


@pytest.mark.parametrize("label", [4.2, True, ["42"], None])
def test_arithmetic_reward_refuses_a_label_that_is_not_text(label):
    with pytest.raises(ValueError, match=f"label .* is a {type(label).__name__}, expected text"):
        reward_func(["40+2=42"], ["40+2="], [label])
    assert reward_func(["40+2=42"], ["40+2="], [42])["rewards"].tolist() == [1.0]  # ints are exact: accepted


# -------------------------------------------------------------------------------------------------- flag checks
def test_flag_name_is_built_from_the_field_path():
    assert flag_name(("rollout", "batch_size")) == "--rollout.batch-size"
    assert flag_name(("actor", "model", "name_or_path")) == "--actor.model.name-or-path"


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_scripts_defaults_pass_the_flag_rules(name):
    check_args(script(name).Args())


def batch_flag(name):
    return ("rollout", "--rollout.batch-size") if name in RL else ("train", "--train.batch-size")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_refuses_batch_size_0_before_loading_anything(name, nothing_loads):
    module = script(name)
    args = module.Args()
    section, flag = batch_flag(name)
    getattr(args, section).batch_size = 0
    with pytest.raises(ValueError, match=f"^{flag} 0: must be > 0$"):
        module.main(args)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_refuses_deepcompile_without_cuda_before_loading_anything(name, nothing_loads):
    """DeepSpeed 0.19.8 runs DeepCompile on CUDA only (`is_deepcompile_supported`): `--ds.deepcompile` here is one
    error naming the flag and the reason, before a model, tokenizer or process group is set up."""
    module = script(name)
    args = module.Args()
    args.ds.deepcompile = True
    with pytest.raises(ValueError, match=r"^--ds\.deepcompile: needs a CUDA GPU and this machine has none \(DeepSpeed "
                                         r"0\.19\.8 runs DeepCompile only on a CUDA accelerator"):  # fmt: skip
        module.main(args)


def test_deepcompile_asks_deepspeed_for_its_compile_passes():
    """On a GPU the flag becomes DeepSpeed's `compile.deepcompile` (its passes are installed by `engine.compile()`,
    which make_engine calls for it); off, the config has no compile section at all."""
    import torch

    from core.config import DSConfig
    from core.engine import ds_config

    assert ds_config(DSConfig(deepcompile=True), torch.float32, 3)["compile"] == {"deepcompile": True}
    assert "compile" not in ds_config(DSConfig(), torch.float32, 3)


@pytest.mark.parametrize("name", ["grpo", "grpo_async"])
def test_grpo_refuses_groups_of_one_before_loading_anything(name, nothing_loads):
    module = script(name)
    args = module.Args()
    args.rollout.n_samples = 1
    with pytest.raises(ValueError, match=r"^--rollout\.n-samples 1: the group-relative advantage needs at least 2"):
        module.main(args)


def test_reinforce_pp_refuses_the_zero_variance_filter_on_groups_of_one(nothing_loads):
    module = script("reinforce_pp")
    args = module.Args()
    args.rollout.n_samples, args.algo.filter_zero_variance = 1, True
    with pytest.raises(ValueError, match=r"--algo\.filter-zero-variance needs --rollout\.n-samples >= 2, got 1"):
        module.main(args)
    args.algo.filter_zero_variance = False
    check_args(args)  # one sample without a baseline or filter is plain REINFORCE++


def test_rloo_refuses_one_sample_and_ppo_accepts_it(nothing_loads):
    rloo, ppo = script("rloo"), script("ppo")
    args = rloo.Args()
    args.rollout.n_samples = 1
    with pytest.raises(ValueError, match=r"--rollout\.n-samples 1: the group-relative advantage needs at least 2"):
        rloo.main(args)
    args = ppo.Args()
    args.rollout.n_samples = 1  # InstructGPT's setting: the critic is the baseline
    check_args(args)


@pytest.mark.parametrize(
    "name, section, key, value, message",
    [
        ("grpo", "reward", "clip", 1e39, r"^--reward\.clip 1e\+39: beyond float32's range"),
        ("grpo", "reward", "clip", math.inf, r"^--reward\.clip inf: must be a finite number"),
        ("grpo", "actor", "lr", math.nan, r"^--actor\.lr nan: must be a finite number"),
        ("ppo", "algo", "lam", 1.5, r"^--algo\.lam 1\.5: must be <= 1"),
        ("sft", "train", "micro_batch_size", 0, r"^--train\.micro-batch-size 0: must be > 0"),
        ("sft", "train", "warmup_steps", -1, r"^--train\.warmup-steps -1: must be >= 0"),
        ("rloo", "train", "minibatches", 0, r"^--train\.minibatches 0: must be > 0"),
        ("ppo", "rollout", "max_new_tokens", 0, r"^--rollout\.max-new-tokens 0: must be > 0"),
        ("dpo", "train", "max_steps", 0, r"^--train\.max-steps 0: must be > 0"),
    ],
)
def test_flag_rules_name_the_flag(nothing_loads, name, section, key, value, message):
    module = script(name)
    args = module.Args()
    setattr(getattr(args, section), key, value)
    with pytest.raises(ValueError, match=message):
        module.main(args)


def test_several_bad_flags_are_listed_together():
    @dataclass
    class Inner:
        batch_size: PosInt = 0
        adam_betas: tuple[float, float] = (0.9, float("nan"))

    @dataclass
    class Outer:
        train: Inner = field(default_factory=Inner)
        seed: NonNegInt = -1
        flag: bool = False
        note: str | None = None

    with pytest.raises(ValueError) as err:
        check_args(Outer())
    assert str(err.value).splitlines() == ["invalid flags:", "  --train.batch-size 0: must be > 0",
                                           "  --train.adam-betas nan: must be a finite number",
                                           "  --seed -1: must be >= 0 (0 turns it off)"]  # fmt: skip


def test_a_field_carries_its_rule_and_no_name_list_decides():
    """The rule is in the field's type: a field of a fork with a new name is checked by its type, and the same name as
    a checked flag elsewhere, without a rule, is not (only finiteness and float32's range hold for every number)."""

    @dataclass
    class Fork:
        my_group_size: PosInt | None = 0
        my_range: OpenInterval = (0.5, 0.5)
        my_bounds: WeightBounds = (0.0, -1.0)
        my_fraction: Fraction = 1.5
        batch_size: int = 0  # no rule: the name alone says nothing
        seed: float = float("inf")

    with pytest.raises(ValueError) as err:
        check_args(Fork())
    assert str(err.value).splitlines() == [
        "invalid flags:", "  --my-group-size 0: must be > 0",
        "  --my-range 0.5 0.5: the interval (0.5, 0.5) is empty; give LOW < HIGH",
        "  --my-bounds 0 -1: weight bounds need 0 <= LOW <= HIGH (a negative or reversed bound flips or zeroes the "
        "gradient it multiplies)", "  --my-fraction 1.5: must be <= 1", "  --seed inf: must be a finite number"]  # fmt: skip
    assert field_rules(Fork, "my_group_size") == ("positive",) and field_rules(Fork, "batch_size") == ()


# ------------------------------------------------------------------------------------------- model-path messages
@pytest.mark.parametrize(
    "name, target, flag",
    [
        ("sft", "model", "--model.name-or-path"),
        ("dpo", "model", "--model.name-or-path"),
        ("grpo", "actor.model", "--actor.model.name-or-path"),
        ("grpo", "ref", "--ref.name-or-path"),
        ("ppo", "critic", "--critic.name-or-path"),
        ("rloo", "actor.model", "--actor.model.name-or-path"),
    ],
)
def test_a_missing_model_folder_names_the_flag_typed(tmp_path, nothing_loads, name, target, flag):
    module = script(name)
    args = module.Args()
    section = args
    for part in target.split("."):
        section = getattr(section, part)
    section.name_or_path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"^{flag} '.*missing': no such model folder"):
        module.main(args)


def test_loaders_name_the_flag_they_are_given(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"^--actor\.model\.name-or-path '.*': no such model folder"):
        models.load_causal_lm(ModelConfig(name_or_path=missing), "--actor.model.name-or-path")
    with pytest.raises(ValueError, match=r"^--critic\.name-or-path '.*': no such model folder"):
        models.load_scalar_model(missing, flag="--critic.name-or-path")
    with pytest.raises(ValueError, match=r"\(--actor\.model\.name-or-path / --actor\.model\.tokenizer\): no such"):
        models.load_tokenizer(missing, "--actor.model.name-or-path / --actor.model.tokenizer")


def test_kto_refuses_a_picture_column_and_rm_asks_for_a_vision_language_model(tmp_path):
    """kto.py offers `--data.image-key` through the shared data section but reads no pictures: refused by name (dpo.py
    and rm.py read them, tests/test_vlm.py). rm.py with pictures on a text model: refused naming the model."""
    from algos import kto, rm

    args = kto.Args(run_dir=str(tmp_path / "kto"))
    args.data.image_key = "image"
    with pytest.raises(ValueError, match=r"--data.image-key 'image': kto.py reads no pictures"):
        kto.main(args)
    args = rm.Args(run_dir=str(tmp_path / "rm"))
    args.data.image_key = "image"
    with pytest.raises(ValueError, match=r"--data.image-key needs a vision-language model .*'cleanrlhf/tiny-sft'"):
        rm.main(args)


# ------------------------------------------------------------------------------------------ one name per idea
@pytest.mark.parametrize("name", ["sft", "dpo", "rm", "kto", "grpo"])
def test_the_micro_batch_token_budget_has_one_flag_name(name, capsys):
    """The RL scripts and the SFT family name the token budget of a micro-batch alike: `--train.max-tokens-per-micro`
    (the SFT family's `--train.max-tokens-per-micro-batch` was the same idea under another name)."""
    import tyro

    with pytest.raises(SystemExit):
        tyro.cli(script(name).Args, args=["--help"])
    out = capsys.readouterr().out
    assert re.search(r"--train\.max-tokens-per-micro(?![\w-])", out), f"{name}.py --help: no such flag"
    assert "--train.max-tokens-per-micro-batch" not in out, f"{name}.py --help: the old name"


# ---------------------------------------------------------------------------------------------- --eval.every 0
@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rm"])
def test_eval_every_0_runs_no_eval_not_even_the_first(name, tmp_path):
    """`--eval.every 0` turns every eval off, the one before the first step included (as in the RL scripts); the
    summary is still written, its eval entries None."""
    module = script(name)
    args = module.Args(run_dir=str(tmp_path / "run"))
    args.train.max_steps, args.train.batch_size, args.eval.every, args.eval.max_samples = 1, 8, 0, 16
    args.logger.quiet, args.logger.tensorboard = True, False
    summary = module.main(args)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = sorted({k for row in rows for k in row if k.startswith("eval/")})
    assert not logged, f"{name}.py --eval.every 0 logged {logged}"
    assert any("train/lr" in row for row in rows), rows  # the step itself was logged
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == summary["steps"] == 1
    evals = {k: v for k, v in summary.items() if k.startswith("eval_")}
    assert evals and all(v is None for v in evals.values()), evals


@pytest.mark.parametrize("name", sorted(RL | {"opd", "cispo", "sapo", "dppo", "gmpo", "gdpo", "opsd"}))
def test_an_lr_scaled_below_the_floor_is_refused_naming_the_flag_before_loading_anything(name, nothing_loads):
    """`--actor.lr-ref-samples 10**30` was taken and scaled the lr to ~1e-31: a run that trains nothing, silently.
    A scale below `LR_SCALE_FLOOR` (1/1000) is refused before anything loads, naming the flag, the samples per
    optimizer step and the lr it would give; at the floor itself the lr is scaled as before."""
    from core.config import LR_SCALE_FLOOR, ActorArgs, actor_lr

    module = script(name)
    args = module.Args()
    samples = args.rollout.batch_size * args.rollout.n_samples / args.train.minibatches
    args.actor.lr_ref_samples = 10**30
    lr = f"{args.actor.lr * samples / 10**30:.3g}"
    with pytest.raises(ValueError, match=rf"^--actor\.lr-ref-samples {10**30}: {samples:g} samples per optimizer step "
                                         rf"would scale --actor\.lr {args.actor.lr:g} by {samples:g}/{10**30} to {lr}, "
                                         r"below 1/1000 of it"):  # fmt: skip
        module.main(args)
    at_floor = ActorArgs(**{**module.ACTOR, "lr": 3e-4, "lr_ref_samples": int(16 / LR_SCALE_FLOOR)})  # lr / 1000: taken
    assert actor_lr(at_floor, 16) == pytest.approx(3e-7, rel=1e-12)
    with pytest.raises(ValueError, match=r"^--actor\.lr-ref-samples 16001: 16 samples .* \(at most 16000 here\)"):
        actor_lr(ActorArgs(**{**module.ACTOR, "lr": 3e-4, "lr_ref_samples": 16001}), 16)
