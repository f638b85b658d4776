"""The user's commands: each feature row of the README and the guide (LoRA, QLoRA and a 4-bit reward model on a Ray
group, pictures, mixture-of-experts, agents, a judge) run as a user runs it, `python algos/<x>.py` from the repository
with the flags on the command line, in a process of its own. The learning tests call a script's `main` in the test
process; these runs are the path they skip: interpreter start, the environment, tyro's parsing of the flags,
`core.noise` and the other process-wide settings. Each is one step on a tiny batch, `--eval.every 0`, `--debug` (after
the step's weight sync the engine's log-probs must equal the trainer's, or the run stops), and asserts what shows the
feature was in effect.

The other rows have command-line runs elsewhere: AutoTP (tests/test_autotp.py `sft_run`, tests/test_dpo.py: torchrun
with `--ds.tensor-parallel-size 2`) and sequence parallelism (tests/test_sequence_parallel.py
`test_sp2_on_two_ranks_trains_as_one_rank`: torchrun with `--train.sp-size 2`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env

from core import embedded

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
QUICK = ["--train.max-steps", "1", "--eval.every", "0", "--logger.quiet", "--logger.no-tensorboard", "--debug"]
PAD = "<|image_pad|>"


def command(script: str, run_dir: Path, *flags: str) -> list[dict]:
    """`python algos/<script>.py <flags>` as the README shows it (from the repository, the venv's interpreter), one
    step, in an environment without what earlier in-process tests set (a process group's variables, vLLM's); its
    metrics.jsonl rows."""
    cmd = [sys.executable, f"algos/{script}.py", *flags, *QUICK, "--run-dir", str(run_dir)]
    env = {k: v for k, v in child_env().items() if not k.startswith("VLLM_") and k != "RAY_ADDRESS"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained_step(rows: list[dict]) -> dict:
    """The one step's row: it trained (a loss, a gradient) and `--debug` checked the engine after its sync."""
    (row,) = [r for r in rows if "loss/policy" in r]
    assert row["step"] == 1 and row["train/grad_norm"] > 0 and "perf/debug_check_s" in row, row
    return row


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------- LoRA and QLoRA


def nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """`w` through bitsandbytes' NF4 with double quantization (what `--actor.model.load-in-4bit` holds) and back."""
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                  quant_storage=torch.uint8)  # fmt: skip
    return bnbf.dequantize_4bit(q, state).to(w.dtype)


def test_qlora_grpo_command_trains_adapters_on_a_4bit_base(tmp_path):
    """The README's and the guide's QLoRA command (`--actor.model.load-in-4bit --actor.model.lora-rank 8 --actor.lr
    1e-3`), adapters on the attention's q and v only: the export is the dequantized base with the adapters merged, so
    a linear without adapters (the MLP's down projection) is exactly the NF4 round trip of the warm start's weight
    (not the weight itself: the base was 4-bit), the adapted q projection is not (its adapters trained), and what is
    neither quantized nor trained (the embedding) is bit-identical."""
    run = tmp_path / "run"
    trained_step(command("grpo", run, "--actor.model.load-in-4bit", "--actor.model.lora-rank", "8",
                         "--actor.model.lora-target-modules", "q_proj,v_proj", "--actor.lr", "1e-3",
                         "--rollout.batch-size", "8", "--rollout.n-samples", "4"))  # fmt: skip
    base, out = weights(embedded.resolve_model("cleanrlhf/tiny-sft")), weights(run / "hf")
    assert set(out) <= set(base) and not any("lora" in k for k in out)  # a plain model, adapters merged
    emb = "model.embed_tokens.weight"
    assert torch.equal(out[emb], base[emb])
    for layer in range(2):
        down, q = (f"model.layers.{layer}.{m}.weight" for m in ("mlp.down_proj", "self_attn.q_proj"))
        assert not torch.equal(out[down], base[down])  # NF4's rounding
        assert torch.equal(out[down], nf4_round_trip(base[down]))
        assert not torch.allclose(out[q], nf4_round_trip(base[q]), rtol=0, atol=1e-7)  # + B·A·alpha/r


def test_lora_grpo_command_with_a_judge_as_the_reward(tmp_path):
    """`--actor.model.lora-rank 8` and `--reward.judge-url URL --reward.judge-prompt FILE` (a stand-in chat endpoint,
    tests/test_judge.py's `Judge`: "Verdict: yes" when the answer is the label). The judge is asked once per sampled
    response and the step's rewards are its verdicts; only the adapters train (merged into the export: the adapted
    linears moved, the embedding and the norms are the warm start's bit for bit)."""
    from test_judge import Judge

    judge, prompt = Judge(), tmp_path / "judge.txt"
    prompt.write_text("Question: {prompt}\nLabel: {label}\nAnswer: {response}\nIs the answer right? End with the line "
                      "`Verdict: yes` or `Verdict: no`.")  # fmt: skip
    run = tmp_path / "run"
    try:
        row = trained_step(command("grpo", run, "--actor.model.lora-rank", "8", "--actor.lr", "1e-3",
                                   "--reward.judge-url", judge.url, "--reward.judge-prompt", str(prompt),
                                   "--rollout.batch-size", "8", "--rollout.n-samples", "4"))  # fmt: skip
    finally:
        judge.close()
    asked = [r["messages"][0]["content"] for r in judge.requests]
    assert len(asked) == 8 * 4
    verdicts = [float(t.split("Label: ")[1].split("\n")[0] == t.split("Answer: ")[1].split("\n")[0]) for t in asked]
    assert 0 < sum(verdicts) < len(verdicts)
    assert row["rollout/reward_mean"] == pytest.approx(sum(verdicts) / len(verdicts))
    for s in samples(run):
        assert s["reward"] in (0.0, 1.0)
    base, out = weights(embedded.resolve_model("cleanrlhf/tiny-sft")), weights(run / "hf")
    frozen = [k for k in out if "embed_tokens" in k or "norm" in k]
    assert frozen and all(torch.equal(out[k], base[k]) for k in frozen)
    assert not torch.equal(
        out["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def test_4bit_reward_model_on_its_own_ray_group_scores_the_rollouts(tmp_path):
    """`--reward.model <rm export> --reward.load-in-4bit --reward.ranks 1`: the reward model's replica on a Ray rank of
    its own loads its body in NF4 (its score head whole): every reward of the step is what that 4-bit model scores
    for the sample's text in this process (within samples.jsonl's rounding), not what the full-precision one does."""
    from core import models
    from rewards.remote import ModelReward

    rm, warm = tmp_path / "rm", embedded.resolve_model("cleanrlhf/tiny-sft")
    torch.manual_seed(0)  # a reward model with a fixed random head, saved as rm.py exports one
    models.load_scalar_model(warm, "fp32").save_pretrained(rm)
    models.load_tokenizer(warm).save_pretrained(rm)
    run = tmp_path / "run"
    trained_step(command("grpo", run, "--reward.model", str(rm), "--reward.load-in-4bit", "--reward.ranks", "1",
                         "--rollout.batch-size", "4", "--rollout.n-samples", "4", "--logger.samples", "16"))  # fmt: skip
    rows = [s for s in samples(run) if s["kind"] == "train"]
    assert len(rows) == 16
    texts, logged = [s["prompt"] + s["response"] for s in rows], torch.tensor([s["reward"] for s in rows])
    four = ModelReward(str(rm), load_in_4bit=True)(texts, [], [])["rewards"]
    full = ModelReward(str(rm))(texts, [], [])["rewards"]
    assert torch.allclose(logged, four, rtol=0, atol=2e-6), (logged, four)
    assert (logged - full).abs().max() > 1e-4  # NF4's rounding: measured 4e-3


# ------------------------------------------------------------------------------------------ MoE and agents


@pytest.fixture(scope="module")
def alternating_reward(tmp_path_factory) -> str:
    """A reward file giving every other query of a call 1: the prompts' groups get a spread of rewards whatever a random
    model writes (every group kept in these runs), so the step trains."""
    path = tmp_path_factory.mktemp("reward") / "alternating.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n    return [float(i % 2) for i in range(len(queries))]\n"
    )
    return str(path)


@pytest.fixture(scope="module")
def alternating_parts(tmp_path_factory) -> str:
    """`alternating_reward` with the named parts gdpo.py normalises (`components`): `odd`, every other query 1 (the
    scalar reward), and `first`, every fourth; both vary within a group of 4 whatever a random model writes."""
    path = tmp_path_factory.mktemp("reward") / "alternating_parts.py"
    path.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    odd = [float(i % 2) for i in range(len(queries))]\n"
        "    first = [float(i % 4 == 0) for i in range(len(queries))]\n"
        "    return {'rewards': odd, 'components': {'odd': odd, 'first': first}}\n"
    )
    return str(path)


def test_moe_grpo_command_logs_the_router_loss_and_trains_the_experts(tmp_path, alternating_reward):
    """The guide's MoE command (`--actor.model.name-or-path <a Qwen2-MoE> --ds.zero-stage 3 --debug`) on the random
    `cleanrlhf/tiny-moe`: the router's aux loss is logged (about k = 2 for near-uniform top-2 routing over 4 experts),
    the engine matched the trainer after the sync of changed experts (`--debug`), and the export's routed experts and
    routers moved."""
    run = tmp_path / "run"
    row = trained_step(command("grpo", run, "--actor.model.name-or-path", "cleanrlhf/tiny-moe", "--ds.zero-stage", "3",
                               "--reward.func", alternating_reward, "--rollout.batch-size", "2",
                               "--rollout.n-samples", "4"))  # fmt: skip
    assert 1.5 < row["loss/router_aux"] < 4, row
    base, out = weights(embedded.resolve_model("cleanrlhf/tiny-moe")), weights(run / "hf")
    experts = [k for k in out if ".mlp.experts." in k or ".mlp.gate." in k]
    assert experts and all(not torch.equal(out[k], base[k]) for k in experts), experts


def test_agent_file_grpo_command_trains_on_two_call_episodes(tmp_path):
    """The agents page's command, `python algos/grpo.py --rollout.agent-file agents/examples/retry_agent.py`: the
    episodes go through the OpenAI-compatible server over the engine, some take the second call, none fails, the
    rewards are the agent's (1, 0.5 or 0), and the update trains on the tokens the engine sampled (`--debug`)."""
    run = tmp_path / "run"
    row = trained_step(command("grpo", run, "--rollout.agent-file", "agents/examples/retry_agent.py",
                               "--rollout.batch-size", "8", "--rollout.n-samples", "4"))  # fmt: skip
    assert row["rollout/agent_errors"] == 0 and 1.0 < row["rollout/agent_calls_mean"] <= 2.0, row
    assert {s["reward"] for s in samples(run)} <= {0.0, 0.5, 1.0}


# ------------------------------------------------------------------------------------------------ pictures


@pytest.fixture(scope="module")
def two_pictures(tmp_path_factory) -> str:
    """A dataset folder (train.jsonl, test.jsonl) of `cleanrlhf/shapes` pictures two to a row, each where the prompt
    places it: "Left <picture> right <picture> total?", the answer the sum of the counts."""
    from core import vision

    folder = tmp_path_factory.mktemp("two_pictures")
    for split, seed in (("train", 0), ("test", 1)):
        rows = embedded.shapes_rows(16, seed)
        slot = vision.IMAGE_PLACEHOLDER
        pairs = [{"prompt": f"Left {slot} right {slot} total?", "image": [a["image"], b["image"]],
                  "answer": str(int(a["answer"]) + int(b["answer"]))} for a, b in zip(rows[::2], rows[1::2])]  # fmt: skip
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return str(folder)


# Every RL script that reads pictures, but grpo.py (tests/test_vlm.py): rloo.py on two pictures per row, cispo.py and
# sapo.py with the LoRA flags their pages show (`--actor.model.lora-rank 8 --actor.lr 1e-3`), gdpo.py with a reward
# of two named parts (`alternating_parts`).
PICTURE_SCRIPTS = ["grpo_async", "rloo", "reinforce_pp", "cispo", "sapo", "opd", "dppo", "gmpo", "gdpo"]
LORA = {"cispo", "sapo"}


@pytest.mark.parametrize("script", PICTURE_SCRIPTS)
def test_rl_script_command_on_pictures(script, tmp_path, alternating_reward, alternating_parts, two_pictures):
    """`python algos/<script>.py --actor.model.name-or-path cleanrlhf/tiny-vl --data.path cleanrlhf/shapes
    --data.image-key image --reward.func ... --debug`, one step from the random tiny-vl. The engine cannot take a
    prompt's image tokens without the pictures (vLLM's processor expands them from `multi_modal_data`), and the
    trainer's log-probs without them differ from the engine's by about 0.1 (measured by dropping them from
    `core.vision.model_kwargs`), so the trained samples' log-probs before the update (samples.jsonl `old_logp`) within
    0.02 of the engine's show the pictures in both. (They differ by up to 3e-3: the engine samples from the
    vocabulary without the image token, whose probability in the random tiny-vl is about 1/V.) opd.py's teacher is the same tiny-vl: its log-probs
    equal the student's, the reverse KL 0, only if it too reads the pictures. cispo.py and sapo.py train LoRA adapters
    only (their pages' command). gdpo.py's reward has parts: each is logged (`reward/<part>`) as the step trains on
    them."""
    per_row = 2 if script == "rloo" else 1
    reward = alternating_parts if script == "gdpo" else alternating_reward
    data = (["--data.path", two_pictures, "--data.max-images-per-prompt", "2"] if per_row == 2
            else ["--data.path", "cleanrlhf/shapes", "--data.max-samples", "16"])  # fmt: skip
    extra = ["--teacher.model", "cleanrlhf/tiny-vl"] if script == "opd" else []
    if script in LORA:
        extra = ["--actor.model.lora-rank", "8", "--actor.lr", "1e-3"]
    run = tmp_path / "run"
    rows = command(script, run, "--actor.model.name-or-path", "cleanrlhf/tiny-vl", "--data.image-key", "image", *data,
                   "--eval.max-samples", "4", "--reward.func", reward, "--rollout.max-new-tokens", "3",
                   "--rollout.batch-size", "2", "--rollout.n-samples", "4", *extra)  # fmt: skip
    (row,) = [r for r in rows if "loss/policy" in r]
    assert "perf/debug_check_s" in row and row["train/tokens"] > 0, row
    if script == "opd":
        assert abs(row["opd/reverse_kl"]) < 1e-5, row
    else:
        assert row["rollout/kept_frac"] == 1.0 and row["train/grad_norm"] > 0, row
    if script == "gdpo":  # the parts' batch means: 1/2 of the queries are odd, 1/4 first in their four
        assert row["reward/odd"] == 0.5 and row["reward/first"] == 0.25, row
    kept = [s for s in samples(run) if s["kept"]]
    assert kept and all(s["prompt"].count(PAD) == per_row for s in kept), kept
    # the trainer's log-probs before the update are the engine's: the trainer saw the pictures too (dppo.py's old
    # log-probs are the engine's own: its trainer's, in the step's first minibatch, are compared instead)
    trainer = "trainer_logp" if script == "dppo" else "old_logp"
    before = [s for s in kept if script != "dppo" or s["minibatch"] == 0]
    assert before, kept
    for s in before:
        assert s["tokens"][trainer] == pytest.approx(s["tokens"]["engine_logp"], abs=0.02), s
    if script in LORA:  # adapters only: merged into the export's linears, the embedding and norms untouched
        base, out = weights(embedded.resolve_model("cleanrlhf/tiny-vl")), weights(run / "hf")
        frozen = [k for k in out if "embed_tokens" in k or "norm" in k]
        assert frozen and all(torch.equal(out[k], base[k]) for k in frozen)
        assert any(not torch.equal(out[k], base[k]) for k in out if k.endswith("q_proj.weight"))
