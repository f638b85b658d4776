"""Flags that would silently turn or zero the policy gradient are refused before anything loads: IS-weight bounds
out of order or negative (`clamp(w, -1, -2)` is -2 on every token: the gradient's sign flips), an empty DAPO
dynamic-sampling interval, a negative distillation reward weight nobody asked for, and a reward model's export given
as the distillation teacher (it loads as a causal LM without complaint)."""

import importlib

import pytest
import torch

from core import models, rl_math
from core.config import ModelConfig, check_args

RL = ["grpo", "grpo_async", "rloo", "reinforce_pp", "ppo", "opd", "cispo", "sapo", "dppo", "gmpo", "gdpo", "opsd"]


def script(name):
    return importlib.import_module(f"algos.{name}")


def having(field: str) -> list[str]:
    return [n for n in RL if hasattr(script(n).AlgoArgs(), field)]


def test_reversed_negative_bounds_would_flip_the_gradient():
    """Why the rule exists: with (lo, hi) = (-1, -2) every IS weight is -2, so the loss's gradient changes sign."""
    old, rollout = torch.zeros(1, 3), torch.tensor([[0.1, -0.2, 0.0]])
    w = rl_math.is_weight(old, rollout, torch.ones(1, 3, dtype=torch.bool), "tis", (-1.0, -2.0))
    assert (w == -2.0).all()


@pytest.mark.parametrize("name", having("is_threshold"))
@pytest.mark.parametrize("bounds, message", [
    ((-1.0, -2.0), r"--algo\.is-threshold -1 -2: weight bounds need 0 <= LOW <= HIGH"),
    ((2.0, 1.0), r"--algo\.is-threshold 2 1: weight bounds need 0 <= LOW <= HIGH"),
    ((-0.5, 5.0), r"--algo\.is-threshold -0\.5 5: weight bounds need 0 <= LOW <= HIGH"),
    ((0.0, 0.0), r"--algo\.is-threshold 0 0: HIGH must be > 0"),
])  # fmt: skip
def test_is_threshold_out_of_order_or_negative_is_refused_before_loading(name, bounds, message, nothing_loads):
    module = script(name)
    args = module.Args()
    args.algo.is_correction, args.algo.is_threshold = "tis", bounds
    with pytest.raises(ValueError, match=message):
        module.main(args)


@pytest.mark.parametrize("bounds", [(0.0, 5.0), (1.0, 1.0), (0.5, 2.0)])
def test_is_threshold_in_order_passes(bounds):
    args = script("grpo").Args()
    args.algo.is_threshold = bounds
    check_args(args)


@pytest.mark.parametrize("name", having("dynamic_filter_range"))
@pytest.mark.parametrize("interval", [(1.0, 0.0), (0.5, 0.5)])
def test_an_empty_dynamic_filter_interval_is_refused_before_loading(name, interval, nothing_loads):
    module = script(name)
    args = module.Args()
    args.algo.dynamic_filter_range = interval
    with pytest.raises(ValueError, match=r"--algo\.dynamic-filter-range .*: the interval .* is empty; give LOW < HIGH"):
        module.main(args)


def test_a_non_empty_dynamic_filter_interval_passes():
    args = script("grpo").Args()
    args.algo.dynamic_filter_range = (0.0, 1.0)
    check_args(args)


def test_opd_refuses_a_negative_reward_coef_unless_asked(nothing_loads, monkeypatch):
    opd = script("opd")
    args = opd.Args()
    args.algo.reward_coef = -0.5
    with pytest.raises(ValueError, match=r"^--algo\.reward-coef -0\.5: a negative weight .* --algo\.negative-reward-coef"):
        opd.main(args)

    class Reached(Exception):
        pass

    def reached(_args):
        raise Reached

    monkeypatch.setattr(opd, "check_teacher", reached)  # the next check after the flags
    args.algo.negative_reward_coef = True
    with pytest.raises(Reached):
        opd.main(args)


@pytest.fixture(scope="module")
def reward_model_export(tiny_path, tmp_path_factory):
    """The tiny model saved as algos/rm.py exports a reward model: a scalar head, `...ForSequenceClassification`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm") / "hf"
    AutoModelForSequenceClassification.from_pretrained(tiny_path, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(out)
    return str(out)


def test_a_reward_model_export_is_refused_as_the_distillation_teacher(reward_model_export):
    opd = script("opd")
    args = opd.Args()
    args.teacher.model = reward_model_export
    with pytest.raises(ValueError, match=r"^--teacher\.model '.*': a Qwen2ForSequenceClassification .*not a causal LM"):
        opd.check_teacher(args)


def test_a_reward_model_export_is_refused_as_a_policy(reward_model_export, tiny_path):
    with pytest.raises(ValueError, match=r"^--actor\.model\.name-or-path '.*': a Qwen2ForSequenceClassification"):
        models.load_causal_lm(ModelConfig(name_or_path=reward_model_export), "--actor.model.name-or-path")
    models.check_causal_lm(str(tiny_path), "--actor.model.name-or-path")  # the causal LM itself passes
