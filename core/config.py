"""Infrastructure config sections shared by the scripts: `--model.*`, `--data.*`, `--ds.*`, `--ref.*`, `--ckpt.*`,
`--logger.*`.

Each script owns one flat-ish `Args` dataclass (its algorithm knobs) and nests these sections, so
`python algos/<name>.py --help` prints grouped, documented flags. Every field's docstring is its help text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    name_or_path: str = "cleanrlhf/tiny"
    """HF model id or local path. `cleanrlhf/tiny` (random init) and `cleanrlhf/tiny-sft` (SFT warm start) are
    the embedded defaults, built on first use under $CLEANRLHF_HOME."""
    tokenizer: str | None = None
    """tokenizer id or path; defaults to the model's."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """parameter and compute dtype: `auto` is bf16 on GPU and fp32 on CPU."""
    attn_implementation: str = "auto"
    """transformers attention backend: `sdpa`, `eager`, `flash_attention_2` (GPU), or `auto`: eager for bf16 on
    CPU (torch's bf16 sdpa kernels are slower there than eager's matmuls; see README, Benchmarks), else sdpa."""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory."""
    lora_rank: int = 0
    """LoRA rank (peft); 0 trains all parameters."""
    lora_alpha: int = 16
    """LoRA scaling alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    lora_target_modules: str = "all-linear"
    """comma-separated module names for LoRA, or `all-linear`."""


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
    """render prompts (and responses) with the tokenizer's chat template."""
    max_samples: int = 100_000_000
    """keep at most this many rows per dataset."""
    max_len: int = 2048
    """drop (or reject, see on-bad-row) samples longer than this many tokens."""
    on_bad_row: Literal["skip", "raise"] = "skip"
    """bad rows (missing key, empty text, too long): skip and count them in the log, or raise naming file/row/key."""


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
    grad_clip: float = 1.0
    """global gradient-norm clipping (0 disables)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: `auto` is nccl with CUDA, gloo on CPU."""
    timeout_s: int = 600
    """timeout of every collective; a dead rank fails after this instead of hanging."""
    compile: bool = False
    """torch.compile the trained model (DeepSpeed's `engine.compile`): fuses the element-wise work between matmuls
    and drops per-op Python overhead. The first steps pay the compilation (20-60 s for the tiny model on CPU, which
    needs a C++ compiler), and a new batch shape can compile again; HF generation (eval) stays eager."""


@dataclass
class RefConfig:
    name_or_path: str | None = None
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


@dataclass
class CkptConfig:
    every: int = 0
    """save a resumable DeepSpeed checkpoint every N optimizer steps (0: never)."""
    keep_last: int = 2
    """number of most recent checkpoints to keep."""
    dir: str | None = None
    """checkpoint folder; default `<run_dir>/checkpoints`."""
    resume: bool = True
    """resume from the latest checkpoint in `dir` when one exists."""


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
