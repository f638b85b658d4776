"""The transformers engine (`--vllm.engine hf`): `HFEngine` generates with transformers' `generate` on its own copy of
the policy in this process, behind the methods of `core.vllm_engine.VLLMEngine`, and samples as vLLM does through
`RowSampler`. For models the installed vLLM cannot serve, a GPU without vLLM, and tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from core import chat, moe
from core.rollout_types import Sample, VLLMConfig
from core.weight_sync import Named


class RowSampler:
    """A transformers logits processor that draws the next token of every row itself (`HFEngine.generate`): the
    distribution vLLM samples with `processed_logprobs` (temperature, then top-p, through transformers' own warpers;
    plain log-softmax at temperature 0, greedy), the draw from prompt i's own generator (seeded `seeds[i]`, its `n`
    rows drawn together), and the returned logits one-hot (0 at the drawn token, −inf elsewhere) so that greedy
    decoding takes it. Records per step the drawn tokens' log-probs (`logps`, (B,) each) and, with `top` > 0, the top
    `top` {token id: log-prob} of each row (`tops`). `suppress`: token ids never drawn. `on_tokens(i, j, ids so far)`:
    called after every step for each sample still running (row i·n + j), until it draws one of `stops`."""

    def __init__(self, seeds: list[int], n: int, temperature: float, top_p: float, suppress: list[int], top: int,
                 device, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 stops: list[int] | None = None):  # fmt: skip
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**64) for s in seeds]
        self.n, self.greedy, self.suppress, self.top = n, temperature <= 0, suppress, top
        self.warpers = [] if self.greedy else [TemperatureLogitsWarper(temperature)] + (
            [TopPLogitsWarper(top_p)] if top_p < 1.0 else [])  # fmt: skip
        self.logps, self.tops = [], []
        self.on_tokens, self.stops = on_tokens, set(stops or [])
        self.drawn: list[list[int]] = [[] for _ in range(len(seeds) * n)]
        self.running = [True] * (len(seeds) * n)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        if self.suppress:
            scores[:, self.suppress] = -float("inf")
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        logp = torch.log_softmax(scores, dim=-1)  # (B, V)
        if self.greedy:
            tokens = logp.argmax(-1)
        else:
            probs = logp.exp()
            tokens = torch.cat([torch.multinomial(probs[i * self.n : (i + 1) * self.n], 1, generator=g)[:, 0]
                                for i, g in enumerate(self.generators)])  # fmt: skip
        self.logps.append(logp.gather(-1, tokens[:, None])[:, 0])
        if self.top > 0:
            best = logp.topk(self.top, dim=-1)
            self.tops.append([dict(zip(i.tolist(), v.tolist())) for v, i in zip(best.values, best.indices)])
        if self.on_tokens is not None:
            for r, t in enumerate(tokens.tolist()):
                if self.running[r]:
                    self.drawn[r].append(t)
                    self.on_tokens(r // self.n, r % self.n, list(self.drawn[r]))
                    self.running[r] = t not in self.stops
        onehot = torch.full_like(scores, -float("inf"))
        return onehot.scatter_(-1, tokens[:, None], 0.0)


class HFEngine:
    """transformers' `generate` on its own copy of the policy, in this process, behind `VLLMEngine`'s methods
    (`--vllm.engine hf`). Weight syncs copy the trainer's tensors into the copy by name (every name of the HF
    checkpoint: a vision tower's too). Sampling as vLLM's with `processed_logprobs`: temperature, then top-p, and
    the log-probs of that processed distribution; at temperature 0 greedy with plain log-softmax log-probs. Prompt i
    is sampled under the torch seed `seed + i * n` (its n samples in one batch), so a sample does not depend on the
    other prompts of the call. Slow next to vLLM (no KV-cache paging, no continuous batching): for models vLLM cannot
    serve here, and tests; with CUDA it runs on this process's GPU, in bf16 under `--vllm.dtype auto` (one-process
    GRPO where vLLM is not installed). Pictures: each prompt's `images[i]` through the model's image processor; a vision-language
    model never samples its image token (a response holding one fails the trainer's forward: the model looks for a
    picture's features for every image token)."""

    def __init__(self, model_path: str, cfg: VLLMConfig, seed: int = 0, name: str = "hf-engine-0",
                 tokenizer: str | None = None):  # fmt: skip
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        cuda = torch.cuda.is_available()  # the trainer's GPU (this process's current device), as vLLM's engine would
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        auto_dtype = torch.bfloat16 if cuda else torch.float32  # `--vllm.dtype auto`, as create_engines reads it
        dtype = {"auto": auto_dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        vision = getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.processor = None
        if vision:
            from transformers import AutoImageProcessor

            self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_path)
        self.stop_token_ids = chat.stop_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_token_ids[0]
        self.name, self.cfg, self.seed = name, cfg, seed
        self.record_routing = False
        """`--actor.routing-replay` (set by `core.rl.start`): each sample carries the experts its tokens were routed to
        (`Sample.routed_experts`, recorded by hooks on the routers during `generate`: `core.moe.record_generate`)."""

    def ready(self) -> str:
        return self.name

    def start_routing_record(self) -> int:
        """`--actor.routing-replay`: set `record_routing`; returns the number of MoE layers."""
        self.record_routing = True
        return len(moe.routers(self.model))

    def _vision(self, ids: torch.Tensor, images: list | None) -> dict:
        """The forward's vision inputs for rows `ids` (b, L) with pictures `images` (b lists of PIL images; None:
        text)."""
        from core import vision

        if not images or all(i is None for i in images) or self.processor is None:
            return {}
        pad = self.model.config.image_token_id
        keys = ("pixel_values", "image_grid_thw")
        rows = [None if i is None else {**dict(zip(keys, vision.process(i, self.processor))), "image_token_id": pad}
                for i in images]  # fmt: skip
        return {k: v.to(self.device) if torch.is_tensor(v) else v
                for k, v in vision.model_kwargs(vision.add_pixels({"input_ids": ids.cpu()}, rows)).items()}  # fmt: skip

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], n: int = 1, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | list[int] | None = None,
                 ignore_eos: bool = False, images: list | None = None, stop: list[str] | None = None,
                 top_logprobs: int = 0, on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 ) -> list[list[Sample]]:  # fmt: skip
        """As `VLLMEngine.generate` (`on_tokens` included), except `stop`: accepted and not applied (samples end at a stop token or the
        limit; the caller cuts at its strings, as agents/openai_server.py does). ONE `generate` call for the whole
        batch (P prompts × n samples, left-padded); each prompt's rows draw from a torch generator of their own
        (`RowSampler`), so a sample does not depend on the other prompts of the call or on their padding."""
        from transformers import GenerationConfig

        P = len(prompt_token_ids)
        if P == 0:
            return []
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        extra = self._vision(ids, None if images is None else [images[i] for i in range(P) for _ in range(n)])
        seeds = [seed[i] if isinstance(seed, list) else (self.seed if seed is None else seed + i * n) for i in range(P)]
        # a picture's token in a response would take image features the model does not have: never sampled
        suppress = [self.model.config.image_token_id] if self.processor is not None else []
        sampler = RowSampler(seeds, n, temperature, top_p, suppress, top_logprobs, self.device, on_tokens,
                             [] if ignore_eos else self.stop_token_ids)  # fmt: skip
        # greedy over the sampler's one-hot logits: the draw is the sampler's. transformers fills every field left None
        # from the model's generation_config.json, so the fields that would change the distribution or the stop are
        # set here: no repetition penalty, and no stop token at all under `ignore_eos` ([]: None would be the model's eos)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                  eos_token_id=[] if ignore_eos else self.stop_token_ids, repetition_penalty=1.0,
                                  no_repeat_ngram_size=0, min_new_tokens=0)  # fmt: skip
        with contextlib.ExitStack() as stack:  # routing replay: the routers' choices of every forward of the call
            calls = stack.enter_context(moe.record_generate(self.model)) if self.record_routing else None
            out = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=config,
                                      logits_processor=[sampler], **extra)  # fmt: skip
        new = out[:, width:].tolist()
        logp = torch.stack(sampler.logps, dim=1).tolist() if sampler.logps else [[] for _ in rows]  # (P·n, T)
        groups = []
        for r, tokens in enumerate(new):
            stop = min((tokens.index(t) for t in self.stop_token_ids if t in tokens), default=None)
            if ignore_eos or stop is None:
                stop, reason = len(tokens) - 1, "length"
            else:
                reason = "stop"
            kept = tokens[: stop + 1]
            top = [sampler.tops[t][r] for t in range(len(kept))] if top_logprobs > 0 else None
            routed = None if calls is None else moe.generated_table(calls, len(rows), r, width, len(rows[r]), len(kept))
            sample = Sample(kept, logp[r][: len(kept)], reason, truncated=reason == "length", top_logprobs=top,
                            routed_experts=routed)  # fmt: skip
            if r % n == 0:
                groups.append([])
            groups[-1].append(sample)
        return groups

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[list[int]], images: list | None = None) -> list[list[float]]:
        out = []
        for i, seq in enumerate(token_ids):
            ids = torch.tensor([list(seq)], device=self.device)
            extra = self._vision(ids, None if images is None else [images[i]])
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logp.tolist())
        return out

    @torch.no_grad()
    def load_weights(self, named: Named) -> int:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"{self.name}: the trainer sent {name!r}, which the engine's model does not have")
            params[name].copy_(tensor.to(params[name].dtype))
        return len(named)

    def load_adapter(self, named: Named, config: dict) -> int:
        raise ValueError("--vllm.engine hf takes merged weights: use --vllm.lora-sync merged")

    def reset_prefix_cache(self) -> bool:
        return True  # no cache outlives a call

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass
