"""Models: load an HF causal LM and tokenizer (optionally with LoRA), a scalar-head model for rewards and critics,
per-token log-probs, the router's load-balancing loss of mixture-of-experts models, and batched greedy generation
for evaluation.

Tested with transformers 5.16-5.19 (Qwen2 and Llama architectures; Qwen2-MoE with transformers 5.19).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from core import chat, embedded, rl_math
from core.config import ModelConfig


def torch_dtype(dtype: str) -> torch.dtype:
    """`auto` is bf16 when CUDA is present and fp32 on CPU (exact for tests, and every CPU has fast fp32 kernels)."""
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def packs_in_one_row(name: str) -> bool:
    """Whether attention backend `name` keeps packed samples apart without a dense (L, L) mask, so a micro-batch is
    best packed into one row: flash-attention's varlen kernels, and FlexAttention's block mask (transformers builds it
    from the restarting `position_ids`; blocks across samples are skipped). sdpa and eager get a block-diagonal dense
    mask, whose cost is quadratic in the row: their rows are kept short."""
    return name.startswith(("flash", "flex"))


def attn_implementation(name: str, dtype: torch.dtype) -> str:
    """The transformers attention backend for `--model.attn-implementation name`: `auto` is eager for bf16 without
    CUDA and sdpa otherwise; any other name is returned as given. On a CPU with AVX-512 bf16, torch 2.13's bf16
    flash-attention kernel (the backward pass above all) ran 2-4x slower than the fp32 one on these short rows,
    so bf16 training through sdpa was slower than fp32, while eager attention's bf16 matmuls are fast.
    `flex_attention` (torch's FlexAttention, compiled on first use) needs CUDA: torch 2.13 has no backward pass for it
    on CPU, so it is refused there with this message instead of failing in the first backward."""
    if name == "flex_attention" and not torch.cuda.is_available():
        raise ValueError("--model.attn-implementation flex_attention: FlexAttention has no backward pass on CPU in "
                         f"torch {torch.__version__} (forward only), so nothing could train; use sdpa or eager on "
                         "CPU, flex_attention or flash_attention_2 on a GPU")  # fmt: skip
    if name != "auto":
        return name
    return "eager" if dtype == torch.bfloat16 and not torch.cuda.is_available() else "sdpa"


def load_tokenizer(name_or_path: str, flag: str = "--model.name-or-path / --model.tokenizer"):
    """AutoTokenizer with a pad token (eos when the model has none). A missing path or hub id is one ValueError
    naming `flag`, the flag(s) the name came from (`--actor.model.name-or-path / --actor.model.tokenizer`)."""
    from transformers import AutoTokenizer

    path = embedded.resolve_model(name_or_path)
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(f"tokenizer {name_or_path!r} ({flag}): no such folder {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ValueError(f"tokenizer {name_or_path!r} ({flag}): cannot load a tokenizer: {e}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_model_path(name_or_path: str, flag: str) -> str:
    path = embedded.resolve_model(name_or_path)
    if path.startswith((".", "/", "~")):
        if not (Path(path).expanduser() / "config.json").exists():
            raise ValueError(f"{flag} {name_or_path!r}: no such model folder (no config.json in {path})")
    return path


def max_positions(name_or_path: str, flag: str = "--model.name-or-path") -> int | None:
    """The model's context length in tokens: `max_position_embeddings` of its config (of its text model, for
    multimodal configs; `n_positions` for GPT-2-style ones), None when the config names neither. Embedded names are
    resolved (and built) as the loaders do; only the config is read. A missing local folder or hub id is one
    ValueError naming `flag`."""
    from transformers import AutoConfig

    path = _check_model_path(name_or_path, flag)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {name_or_path!r}: cannot read the model's config: {e}") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


# Architectures whose head is not a language model's: a reward model's export (algos/rm.py writes
# `...ForSequenceClassification`) loads as a causal LM without an error (its body under the tied embeddings' head),
# and would score or generate from a model trained for another job.
NOT_CAUSAL_LM = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def check_causal_lm(name_or_path: str, flag: str = "--model.name-or-path") -> None:
    """Refuse a model whose config names only non-LM heads (`NOT_CAUSAL_LM`: a reward model's export), with one
    ValueError naming `flag`; reads the config only. A config without `architectures` passes."""
    from transformers import AutoConfig

    path = _check_model_path(name_or_path, flag)
    try:
        archs = list(getattr(AutoConfig.from_pretrained(path), "architectures", None) or [])
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {name_or_path!r}: cannot read the model's config: {e}") from None
    if archs and all(a.endswith(NOT_CAUSAL_LM) for a in archs):
        raise ValueError(f"{flag} {name_or_path!r}: a {', '.join(archs)} (a reward model's export, or another "
                         "non-LM head), not a causal LM; give a policy or SFT model")  # fmt: skip


def load_causal_lm(cfg: ModelConfig, flag: str = "--model.name-or-path", frozen: bool = False):
    """Load the policy as an HF causal LM in `cfg.dtype`, with gradient checkpointing and LoRA as configured.
    `frozen`: a model that only runs forward passes (a reference, a teacher), which may load in 4-bit without LoRA.
    A missing path or hub id gives one clear ValueError naming `flag` (the flag `cfg.name_or_path` came from, e.g.
    `--actor.model.name-or-path`) instead of a hub traceback. A vision-language model (a config with a
    `vision_config`, e.g. Qwen2-VL) loads as `AutoModelForImageTextToText`: the same causal LM head over text, with
    its vision tower (trained too)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    prefix = flag.removesuffix("name-or-path")  # `--actor.model.`: the section's other flags
    if not frozen:
        check_4bit_training(cfg.load_in_4bit, cfg.lora_rank, prefix)
    check_causal_lm(cfg.name_or_path, flag)
    path = _check_model_path(cfg.name_or_path, flag)
    try:
        dtype = torch_dtype(cfg.dtype)
        vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation(cfg.attn_implementation, dtype),
            **(four_bit(dtype) if cfg.load_in_4bit else {}),
        )  # fmt: skip
    except OSError as e:
        raise ValueError(f"{flag} {cfg.name_or_path!r}: cannot load a causal LM: {e}") from None
    except Exception as e:
        raise damaged_weights(e, path, flag, cfg.name_or_path) from None
    if cfg.load_in_4bit:
        no_packed_4bit_inference(model)
    if is_moe(model):  # forwards without a KV cache compute the router's aux loss; `router_aux_loss` hands it over
        model.register_forward_pre_hook(_ask_router_aux_loss, with_kwargs=True)
        model.register_forward_hook(_keep_router_aux_loss)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if cfg.load_in_4bit:  # no parameter before the first adapter trains: checkpointed blocks need an input grad
            model.enable_input_require_grads()
    if cfg.lora_rank > 0:
        model = add_lora(model, cfg)
    return model


def add_lora(model, cfg: ModelConfig, task_type: str = "CAUSAL_LM", whole: tuple[str, ...] = ()):
    """`model` with PEFT LoRA adapters as `cfg` says (`--model.lora-rank`, alpha, dropout, target modules); the
    modules named in `whole` (a reward model's `score` head, which starts untrained) train whole beside them (PEFT's
    `modules_to_save`) and are kept out of the LoRA targets."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    if targets == "all-linear" and whole:  # every linear but the ones that train whole
        targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Linear4bit"} - set(whole))  # fmt: skip
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets if targets == "all-linear" or isinstance(targets, list) else targets.split(","),
        task_type=task_type,
        modules_to_save=list(whole) or None,
    )
    return get_peft_model(model, lora)


def four_bit(dtype: torch.dtype, keep: tuple[str, ...] = ()) -> dict:
    """`from_pretrained` arguments that load a model's linears in 4-bit NF4 with double quantization (QLoRA's recipe;
    bitsandbytes' CPU kernels on a CPU), computing in `dtype`, on this process's device (`LOCAL_RANK`'s GPU, or the
    CPU). The LM head and embeddings stay in `dtype` (transformers keeps the output layer unquantized), and so do the
    modules named in `keep` (a reward model's one-output `score` head)."""
    from transformers import BitsAndBytesConfig

    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8,
                                llm_int8_skip_modules=list(keep) or None)  # fmt: skip
    return {"quantization_config": config, "device_map": {"": device}}


def no_packed_4bit_inference(model) -> None:
    """Keep every 4-bit linear of `model` on bitsandbytes' one CPU path: dequantize the NF4 weight to the compute
    dtype, then `F.linear`, the same arithmetic and autograd on every CPU. Where the CPU has AVX512-BF16 (Zen 4,
    Sapphire Rapids and later), bitsandbytes 0.50's `Linear4bit.forward` otherwise repacks the weight in place into
    an inference-only layout the first time it runs in eval mode on an input without grad (an eval, a log-prob pass
    under `no_grad`), and from then on, in training too, multiplies in bf16 through a kernel with no backward whose
    `result += bias` fails under autograd ("a view of a leaf Variable ... in-place operation"). So a QLoRA model would
    compute another policy than the dequantized weights the engines get (bf16 rounding, ~5e-3 in the logits) and
    stop training at its first update after an eval. The switch is the module's own `support_avx512bf16_for_cpu`."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def is_4bit(model) -> bool:
    """Whether `model` (an HF model, a PEFT model or a DeepSpeed engine around one) holds 4-bit bitsandbytes weights."""
    hf = getattr(model, "module", model)
    return bool(getattr(hf, "is_loaded_in_4bit", False) or getattr(getattr(hf, "base_model", None), "is_loaded_in_4bit", False)
                or any(type(p).__name__ == "Params4bit" for p in hf.parameters()))  # fmt: skip


def is_moe(model) -> bool:
    """A mixture-of-experts causal LM with a router load-balancing loss (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...):
    its config has `router_aux_loss_coef`."""
    return getattr(getattr(model, "config", None), "router_aux_loss_coef", None) is not None


def _ask_router_aux_loss(module, args, kwargs):
    # Training and scoring forwards (use_cache=False, all of them here) return the aux loss. Generation does not ask
    # for it: transformers 5.19's aux loss fails on a decoding step (the attention mask spans the whole sequence, the
    # router logits only the new token), which `output_router_logits=True` in the config would make every step do.
    # Nor does a forward with a 4-D attention mask (dpo.py's shared-prompt rows), whose mask transformers 5.19's
    # aux loss flattens as if it were (B, T): "The size of tensor a (240) must match the size of tensor b (3600)".
    mask = kwargs.get("attention_mask")
    if kwargs.get("use_cache") is False and (mask is None or mask.dim() == 2):
        kwargs.setdefault("output_router_logits", True)
    return args, kwargs


def _keep_router_aux_loss(module, args, output) -> None:
    aux = getattr(output, "aux_loss", None)
    module.__dict__["_router_aux_loss"] = aux if isinstance(aux, torch.Tensor) else None


def router_aux_loss(model) -> torch.Tensor | None:
    """The router's load-balancing loss of the latest forward without a KV cache (`use_cache=False`, as every training
    and scoring forward here) of a mixture-of-experts model loaded by `load_causal_lm`, a scalar in that forward's
    graph (so it can be added to a loss), or None (a dense model, generation, or already taken). `model`: the HF
    model, a DeepSpeed engine around it, or a PEFT model. The value is handed over once, so no forward's graph
    outlives its step.

    transformers' `load_balancing_loss_func` (Switch Transformer, Fedus et al. 2021, eq. 4-6): with f_i the share of
    top-k assignments and P_i the mean router probability of expert i over the forward's tokens and layers,
    aux = E · Σ_i f_i · P_i: about k (the experts per token) when routing is uniform, up to E when it collapses.
    The tokens are the forward's rows: padding masked out for padded batches (attention_mask), the pad segment of a
    packed row included (packed batches pass position ids only)."""
    hf = getattr(model, "module", model)
    hf = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    return hf.__dict__.pop("_router_aux_loss", None)


def damaged_weights(error: Exception, path: str, flag: str, name: str) -> Exception:
    """A ValueError naming the weights file that does not open (a truncated or corrupted `*.safetensors`, e.g. from
    a full disk or an interrupted copy) and the flag that pointed to it, when `error` came from one; `error` itself
    otherwise (a fault of the model code, not of its files)."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(error, SafetensorError) or not Path(path).is_dir():
        return error
    bad = []
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as e:  # noqa: BLE001  (each damaged file is named with its own error)
            bad.append(f"{file} ({e})")
    what = "; ".join(bad) or f"a weights file under {path} ({error})"
    return ValueError(f"{flag} {name!r}: damaged weights file: {what}. Export or copy the model again.")


# A vision-language checkpoint saved as Qwen2-VL's ForConditionalGeneration in the older layout (the text decoder at
# `model.*`, the vision tower at `visual.*`) under the names of `vl_scalar_class`'s body (`model.language_model.*`,
# `model.visual.*`); transformers renames them so for its own classes only (conversion_mapping.py, qwen2_vl).
VL_KEYS = {r"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"}


@functools.cache
def vl_scalar_class(config_class: type) -> type:
    """A scalar-head class for a vision-language config (Qwen2-VL), which transformers 5.19's
    AutoModelForSequenceClassification has none for: the model's multimodal body (`AutoModel`: vision tower + text
    decoder, `model`) with a `score` linear on its hidden states, as transformers builds its text models' classes
    (`GenericForSequenceClassification`). `token_values` runs it like any scalar model; its forward takes the
    pictures (`pixel_values`, `image_grid_thw`) as the body does. Saved folders load back through `load_scalar_model`."""
    from transformers import AutoModel
    from transformers.modeling_layers import GenericForSequenceClassification

    body = AutoModel._model_mapping[config_class]  # e.g. Qwen2VLModel
    pretrained = next(c for c in body.__mro__[1:] if c.__name__.endswith("PreTrainedModel"))
    name = body.__name__.removesuffix("Model") + "ForSequenceClassification"
    return type(name, (GenericForSequenceClassification, pretrained), {"__module__": __name__})


def load_scalar_model(name_or_path: str, dtype: str = "auto", attn: str = "auto", flag: str = "--model.name-or-path",
                      load_in_4bit: bool = False, lora_rank: int = 0):  # fmt: skip
    """A causal LM body with a scalar head (`AutoModelForSequenceClassification`, num_labels=1): the reward model
    and the critic. Loading a plain causal LM initialises a fresh head; `save_pretrained` output loads back with
    `AutoModelForSequenceClassification.from_pretrained`. `attn`: as `--model.attn-implementation`. Load errors name
    `flag`, the flag `name_or_path` came from (`--critic.name-or-path`, `--reward.model`). `load_in_4bit`: the body's
    linears in 4-bit NF4 (`four_bit`; the score head stays in `dtype`). `lora_rank` > 0: LoRA adapters on the body,
    the fresh score head training whole beside them (`add_lora`); a trained 4-bit model needs them, and a 4-bit model
    without them is frozen (a reward model that scores). A vision-language config (Qwen2-VL) gets `vl_scalar_class`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = _check_model_path(name_or_path, flag)
    try:
        torch_dt = torch_dtype(dtype)
        config = AutoConfig.from_pretrained(path)
        vl = getattr(config, "vision_config", None) is not None
        model = (vl_scalar_class(type(config)) if vl else AutoModelForSequenceClassification).from_pretrained(
            path, num_labels=1, dtype=torch_dt, attn_implementation=attn_implementation(attn, torch_dt),
            **(four_bit(torch_dt, keep=("score",)) if load_in_4bit else {}), **({"key_mapping": VL_KEYS} if vl else {}),
        )  # fmt: skip
    except OSError as e:
        raise ValueError(f"{flag} {name_or_path!r}: cannot load a scalar-head model: {e}") from None
    except Exception as e:
        raise damaged_weights(e, path, flag, name_or_path) from None
    if load_in_4bit:
        no_packed_4bit_inference(model)
    text = model.config.get_text_config()  # a vision-language config keeps it in its text config
    text.pad_token_id = text.pad_token_id if getattr(text, "pad_token_id", None) is not None else 0
    if lora_rank > 0:
        model = add_lora(model, ModelConfig(lora_rank=lora_rank), "SEQ_CLS", whole=("score",))
    return model


def check_4bit_training(load_in_4bit: bool, lora_rank: int, section: str = "--model.") -> None:
    """A trained model in 4-bit needs LoRA: its NF4 codes have no gradient. ValueError naming both flags of `section`."""
    if load_in_4bit and lora_rank <= 0:
        raise ValueError(f"{section}load-in-4bit needs {section}lora-rank > 0: the 4-bit body is frozen (its NF4 codes "
                         "have no gradient), so only LoRA adapters (and a scalar head) can train on it (QLoRA)")


# Config fields of architectures whose forward rescales or caps the LM head's output after the head (Gemma 2/3,
# Granite, Cohere): their log-probs go through the full-logits path, so that post-processing is applied.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logits_scaling", "logit_scale")


def chunked_head(model) -> torch.nn.Linear | None:
    """The LM head `causal_logprobs` can run a chunk of tokens at a time (a bias-free nn.Linear whose output the
    model does not post-process, in a model that is not torch.compiled), else None. `model`: an HF causal LM, a
    DeepSpeed engine around one, or a PEFT model (a LoRA-wrapped head is not plain and takes the full path)."""
    hf = getattr(model, "module", model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    config = getattr(hf, "config", None)
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_POSTPROCESSING):
        return None
    if getattr(hf, "_compiled_call_impl", None) is not None:  # --ds.compile: do not retrace around a patched head
        return None
    return head


def causal_logprobs(model, inputs: dict, at: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    entropy: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """log p(labels[k] | context) where the model's hidden state at flat position `at[k]` of the (R, W) forward of
    `inputs` predicts labels[k], and optionally the entropy there; (N,) float32 each.

    Only the N target positions go through the LM head, `chunk` tokens at a time (`rl_math.head_logprobs`: the
    (N, vocab) float32 logits never exist at once; default chunk: 2^25 logits, 128 MiB). The chunked head runs inside
    the head module's own forward (its `forward` is swapped for the call), so DeepSpeed's hooks still gather a ZeRO-3
    partitioned weight for forward and backward, a tied weight is the embedding's, and the gradients accumulate as
    for any forward of the engine. Heads `chunked_head` rejects take the full-logits path."""
    head = chunked_head(model)
    if head is None:
        logits = model(**inputs, use_cache=False).logits
        picked = logits.reshape(-1, logits.shape[-1])[at]  # (N, V)
        logp = rl_math.logprobs_from_logits(picked[None], labels[None], temperature=temperature)[0].float()
        ent = rl_math.entropy_from_logits(picked.float() / temperature) if entropy else None
        return logp, ent
    chunk = chunk or max(1, 2**25 // head.out_features)

    def head_forward(hidden: torch.Tensor) -> torch.Tensor:  # (R, W, H) -> (N, 2): logp, entropy (or 0)
        h = hidden.reshape(-1, hidden.shape[-1])[at]
        logp, ent = rl_math.head_logprobs(h, head.weight, labels, temperature, chunk, entropy)
        return torch.stack([logp, ent if entropy else torch.zeros_like(logp)], dim=-1)

    head.forward = head_forward  # an instance attribute: nn.Module.__call__ (with DeepSpeed's hooks) calls it
    try:
        out = model(**inputs, use_cache=False).logits  # what the head returned, through the hooks
    finally:
        del head.forward
    return out[:, 0], (out[:, 1] if entropy else None)


def token_values(model, input_ids: torch.Tensor, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
    """Per-token scalar outputs (B, T) of a sequence-classification model: the head applied to every hidden state
    (a critic's values; a reward model reads the last valid position). `kwargs` reach the attention function (the
    SP forward's group and mask, `core.sequence_parallel.token_values`)."""
    model = model.get_base_model() if hasattr(model, "peft_config") else model  # LoRA layers sit inside it
    body = getattr(model, model.base_model_prefix)
    # use_cache=False: with a KV cache transformers does not turn restarting position ids into a block-diagonal
    # mask, and packed samples would attend to each other.
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                  **kwargs).last_hidden_state  # fmt: skip
    return model.score(hidden).squeeze(-1).float()


class TokenValues(torch.nn.Module):
    """A scalar-head model whose forward returns `token_values` (B, T): the critic and the reward model as trained.
    Give DeepSpeed this wrapper and call the engine itself, never submodules of `engine.module`: under ZeRO-3,
    DeepSpeed 0.19.8 accumulated gradients over micro-batches only through the engine's own forward (calling the
    model around it kept 15.1 of a 26.8 gradient norm over two micro-batches; tests/test_models.py)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        return token_values(self.model, input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def at_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,): per-token values (B, T) of right-padded rows read at each row's last non-pad token."""
    return values.gather(1, (attention_mask.long().sum(-1) - 1).unsqueeze(1)).squeeze(1)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
    """Reward of each right-padded sequence (B,): the scalar head at its last non-pad token. `kwargs` go to the
    forward (a vision-language model's pictures, `core.vision.model_kwargs`)."""
    return at_last_token(token_values(model, input_ids, attention_mask=attention_mask, **kwargs), attention_mask)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 256,
                    synced_gpus: bool = False):  # fmt: skip
    """Greedy continuations (lists of token ids, the stop token and after removed) for prompt token lists; left
    padding. A continuation stops at eos or at the chat template's end-of-turn token (`core.chat.stop_ids`).
    `synced_gpus=True` keeps ZeRO-3 ranks stepping together until all of them are done."""
    model.eval()
    device = next(model.parameters()).device
    pad, stops = tokenizer.pad_token_id, chat.stop_ids(tokenizer)
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        attn = (
            torch.arange(width, device=device)[None]
            >= (width - torch.tensor([len(p) for p in chunk], device=device))[:, None]
        ).long()
        with torch.compiler.set_stance("force_eager"):  # a --ds.compile model: one shape per decode step
            gen = model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=pad, eos_token_id=stops, synced_gpus=synced_gpus,
            )  # fmt: skip
        for row in gen[:, width:].tolist():
            out.append(row[: min((row.index(t) for t in stops if t in row), default=len(row))])
    return out
