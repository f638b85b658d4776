"""The trainer's weights read out whole, for weight sync and export, without touching the trained model: the full
state dict on rank 0 (`gathered_state_dict`), every parameter gathered a decoder layer at a time under ZeRO-3
(`full_named_parameters`) or this rank's own ZeRO-3 partitions as they are (`zero3_partitions`), AutoTP shards
gathered over their tensor-parallel group (`tp_full`), AutoEP's experts over their expert-parallel group (`ep_full`)
under the HF model's names (`ep_hf_named`), 4-bit weights dequantized (`dequantized`), and a LoRA model's
weights merged under the HF checkpoint's names (`merged_named_parameters`) or its adapter factors as a saved PEFT
adapter names them (`adapter_named_parameters`, `adapter_config`). `core.engine.export_hf` and
`core.placement.sync_weights` read the trainer through these.

Tested with deepspeed 0.19.8 and peft 0.21 (the internals each function reads are named in its docstring).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist


def tp_size(engine) -> int:
    """The tensor-parallel size of a DeepSpeed engine (`--ds.tensor-parallel-size`; 1 without AutoTP)."""
    size = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
    return max(1, int(size or 1))


def ep_size(engine) -> int:
    """The expert-parallel size of a DeepSpeed engine (`--ds.expert-parallel-size`; 1 without AutoEP)."""
    config = getattr(getattr(engine, "_config", None), "expert_parallel_config", None)
    return int(config.autoep_size) if config is not None and config.enabled else 1


def ep_sharded(p: torch.Tensor) -> bool:
    """Whether `p` holds one rank's experts of an MoE layer AutoEP split over its expert-parallel group (DeepSpeed
    0.19.8's `GroupedExperts` weights `w1`, `w2`, `w3`, shaped (local experts, ...), tagged `allreduce = False` and
    a `group_name` like DeepSpeed's own MoE experts); the router, the shared expert and the rest stay whole."""
    return getattr(p, "allreduce", True) is False and hasattr(p, "group_name")


def tp_sharded(p: torch.Tensor) -> bool:
    """Whether `p` is one rank's shard of a weight AutoTP split over its tensor-parallel group (DeepSpeed 0.19.8 tags
    them `tensor_model_parallel`; a row-parallel layer's bias, norms and the rest stay whole on every rank)."""
    return bool(getattr(p, "tensor_model_parallel", False))


def tp_full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an AutoTP-sharded parameter, gathered over its tensor-parallel group into a new tensor
    (the layer's own `gather_params`, given a copy: the trained parameter keeps its shard and its place in the
    optimizer's buffers); any other parameter detached as it is. Collective over the TP group for a shard: the ranks
    of a group must ask for the same parameters in the same order."""
    if not tp_sharded(p):
        return p.detach()
    copy = p.detach().clone()
    p.gather_params([copy])  # rebinds copy.data to the gathered weight
    return copy


def ep_full(p: torch.Tensor) -> torch.Tensor:
    """All experts of an AutoEP-sharded expert weight (`ep_sharded`), gathered over its expert-parallel group into a
    new tensor (E, ...) in expert order: DeepSpeed 0.19.8 gives rank r of the group (its rank in the group, `ep_rank`)
    the consecutive experts r·E/N to (r+1)·E/N − 1 (`legacy_uniform_autoep_placement_descriptor`), so the group's
    pieces, in group-rank order, concatenate along dim 0. Collective over the group. Under ZeRO-3 the caller gathers
    the rank's own experts first (their partition group is the expert-data-parallel one)."""
    from deepspeed.utils import groups

    group = groups._get_expert_parallel_group(p.group_name)
    local = p.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts)


def _autoep_layers(model) -> dict[str, torch.nn.Module]:
    """{module name: layer} of the MoE blocks AutoEP replaced in `model` (DeepSpeed 0.19.8's `AutoEPMoELayer`)."""
    return {n: m for n, m in model.named_modules() if getattr(m, "_is_autoep_layer", False)}


def ep_hf_named(model, named):
    """(name, tensor) pairs of an AutoEP model, with its experts already whole (`ep_full`), under the HF model's own
    names and layout, so that the export and the engines get the checkpoint they would get without expert
    parallelism. Inside each replaced MoE block (DeepSpeed 0.19.8's `AutoEPMoELayer`, whose preset, named by its
    `model_family`, records the HF block's attribute names): `router.gate.*` -> the HF router (`gate.*`),
    `experts.w1` (gate) and `experts.w3` (up), each (E, ffn, hidden) -> the fused (E, 2·ffn, hidden) HF tensor
    (`experts.gate_up_proj`, gate rows first, as `_repack_fused_3d` split it), `experts.w2` -> `experts.down_proj`,
    `shared_experts.*` / `shared_experts_gate.*` -> the HF shared expert and its gate. Other names pass through."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    layers = _autoep_layers(model)
    held: dict[str, torch.Tensor] = {}  # a block's expert weights, until all three have come
    for name, t in named:
        prefix, _, rest = name.rpartition(".mlp.")
        prefix = f"{prefix}.mlp" if prefix else ""
        layer = layers.get(prefix)
        if layer is None:
            yield name, t
            continue
        preset = PRESET_MODELS[layer.model_family]
        experts = f"{prefix}.{preset.experts_pattern}"
        if rest.startswith("router.gate."):
            yield f"{prefix}.{preset.router_pattern}.{rest.removeprefix('router.gate.')}", t
        elif rest in ("experts.w1", "experts.w2", "experts.w3"):  # all three, then in the HF model's order
            held[rest] = t
            if len(held) < 3:
                continue
            w1, w2, w3 = (held.pop(f"experts.w{i}") for i in (1, 2, 3))
            if preset.expert_w3 is None:  # fused gate and up: (E, 2·ffn, hidden), gate rows first
                yield f"{experts}.{preset.expert_w1}", torch.cat([w1, w3], 1)
            else:
                yield f"{experts}.{preset.expert_w1}", w1
                yield f"{experts}.{preset.expert_w3}", w3
            yield f"{experts}.{preset.expert_w2}", w2
        elif rest.startswith("shared_experts_gate."):
            yield f"{prefix}.{preset.shared_experts_gate_pattern}.{rest.removeprefix('shared_experts_gate.')}", t
        elif rest.startswith("shared_experts."):
            yield f"{prefix}.{preset.shared_experts_pattern}.{rest.removeprefix('shared_experts.')}", t
        else:
            raise AssertionError(f"AutoEP parameter {name} has no HF name here (deepspeed 0.19.8's layout expected)")
    assert not held, f"AutoEP experts without their pair: {sorted(held)}"


def gathered_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full parameters as a CPU state dict on rank 0 (ZeRO-3 shards gathered); None on other ranks.
    Every rank must call it (the gather is collective)."""
    import deepspeed

    model = engine.module
    zero3 = engine.zero_optimization_stage() == 3
    if ep_size(engine) > 1:  # AutoEP: whole experts gathered over their group, under the HF model's names
        state = {n: t.to("cpu", copy=True) for n, t in full_named_parameters(engine)}
        return state if dist.get_rank() == 0 else None
    if tp_size(engine) > 1:  # AutoTP: every rank gathers each shard with its group (a layer at a time under ZeRO-3)
        state = {n: t.to("cpu", copy=True) for n, t in full_named_parameters(engine)}
        params = dict(model.named_parameters(remove_duplicate=False))  # a tied head: the embedding's tensor
        state = {k: state[_tied_name(model, k, params)] if k in params else v.detach().to("cpu", copy=True)
                 for k, v in model.state_dict().items()}  # fmt: skip
        return state if dist.get_rank() == 0 else None
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None, enabled=zero3):
        if dist.get_rank() != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _tied_name(model, name: str, params: dict) -> str:
    """The name under which `named_parameters()` (duplicates removed) lists the tensor of parameter `name`."""
    target = params[name]
    return next(n for n, p in model.named_parameters() if p is target)


LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def gather_groups(named: list[tuple[str, torch.nn.Parameter]]) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive parameters split into the groups gathered together for weight sync: one decoder layer
    (`...layers.N.`) per group, each other parameter alone (embeddings, final norm, head: the large ones)."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    key = None
    for name, p in named:
        m = LAYER_PREFIX.match(name)
        k = m.group(1) if m else None
        if k is None or k != key:
            groups.append([])
        groups[-1].append((name, p))
        key = k
    return groups


def full_named_parameters(engine, keep=None):
    """Yield (name, full tensor) for every trainer parameter, for weight sync; `keep(name)` False skips a parameter
    (never gathered; with AutoEP, `--ds.expert-parallel-size`, every parameter is yielded whole under its HF name,
    `ep_hf_named`). Under ZeRO-3 a decoder layer's parameters are gathered together (one coalesced all-gather per
    layer, `gather_groups`) and copied out before the next layer is gathered, so one layer is held at a time
    (collective: every rank must iterate to the end, with the same `keep`); otherwise the live tensors. Under AutoTP
    (`--ds.tensor-parallel-size`) each shard is gathered over its tensor-parallel group (`tp_full`): collective too.
    Gathering parameter by parameter cost a collective each: ~290 for a 24-layer Qwen2, about three quarters of a
    0.5B-shaped model's sync on 2 CPU ranks."""
    if ep_size(engine) > 1:  # AutoEP: whole experts (collective), under the HF model's names
        yield from ep_hf_named(engine.module, _full_named(engine, None))
        return
    yield from _full_named(engine, keep)


def _full_named(engine, keep):
    import deepspeed

    def whole(p):  # AutoTP: a shard gathered, AutoEP: the group's experts (collectives)
        return tp_full(p) if tp_sharded(p) else ep_full(p) if ep_sharded(p) else None

    named = [(n, p) for n, p in engine.module.named_parameters() if keep is None or keep(n)]
    if engine.zero_optimization_stage() != 3:
        for name, p in named:
            full = whole(p)
            yield name, dequantized(p) if full is None else full
        return
    for group in gather_groups(named):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            full = [(name, t if (t := whole(p)) is not None else p.detach().clone()) for name, p in group]
        yield from full


def dequantized(p: torch.Tensor) -> torch.Tensor:
    """A parameter as the forward computes with it: a 4-bit bitsandbytes weight (`--model.load-in-4bit`, QLoRA)
    dequantized to its compute dtype (the engines and the export get what the trainer's linears multiply by, NF4
    rounding included); any other parameter detached as it is."""
    state = getattr(p, "quant_state", None)
    if state is None or type(p).__name__ != "Params4bit":
        return p.detach()
    import bitsandbytes.functional as bnb_f

    return bnb_f.dequantize_4bit(p.data, state).to(state.dtype)


def zero3_partitions(engine) -> tuple[list[tuple[str, torch.Tensor, torch.Size]] | None, str]:
    """This rank's own ZeRO-3 partitions, for a weight sync without a gather: ([(name, partition, full shape)], "")
    in `named_parameters` order, or (None, why) where they cannot be sent as they are. Reads DeepSpeed internals
    (checked against deepspeed 0.19.8's `partition_parameters.py`): `param.ds_tensor` is the flat partition of
    rank r of the parameter's partition group, elements [r·s, (r + 1)·s) of the flattened full tensor with
    s = ceil(numel / world) (`_partition_param`, `_aligned_size`), zero-padded past numel on the last rank(s); the
    optimizer writes its updated partition there. No collective: every rank returns the same answer from the same
    model and config. Not sent as they are: other stages, a partition group that is not the whole world in rank order
    (e.g. hierarchical / expert groups), partitions swapped out to NVMe or quantized."""
    if engine.zero_optimization_stage() != 3:
        return None, f"ZeRO stage {engine.zero_optimization_stage()} keeps no partitions"
    if tp_size(engine) > 1:
        return None, "AutoTP (--ds.tensor-parallel-size): the partitions are of tensor-parallel shards"
    if ep_size(engine) > 1:
        return None, "AutoEP (--ds.expert-parallel-size): the experts' partitions are of each rank's experts"
    world = dist.get_world_size()
    checked: set[int] = set()
    out = []
    for name, p in engine.module.named_parameters():
        part, group = getattr(p, "ds_tensor", None), getattr(p, "ds_process_group", None)
        if part is None:
            return None, f"{name} has no ZeRO-3 partition"
        if id(group) not in checked:
            if dist.get_world_size(group) != world or any(dist.get_global_rank(group, i) != i for i in range(world)):
                return None, f"{name} is partitioned over a group other than the whole world in rank order"
            checked.add(id(group))
        if getattr(part, "final_location", None) is not None or hasattr(part, "ds_quant_scale"):
            return None, f"{name}'s partition is swapped to NVMe or quantized"
        assert part.numel() == -(-p.ds_numel // world), (name, part.numel(), p.ds_numel, world)
        out.append((name, part.detach().view(-1), p.ds_shape))
    return out, ""


# ------------------------------------------------------------------------------- LoRA weights for the engines
# PEFT (tested with peft 0.21) names a LoRA-wrapped linear `base_model.model.<hf name>.base_layer.weight` (+ `.bias`)
# beside its factors `<...>.lora_A.<adapter>.weight` (r, in) and `<...>.lora_B.<adapter>.weight` (out, r); the
# wrapped model's other parameters are `base_model.model.<hf name>`.
_PEFT_PREFIX = "base_model.model."
_LORA_PART = re.compile(r"\.(base_layer|lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


def lora_modules(model) -> dict[str, tuple[float, bool]]:
    """{PEFT module name: (scaling, fan_in_fan_out)} of the active adapter's LoRA linears of a PEFT model (`{}` for a
    plain model). scaling is lora_alpha / r (alpha / sqrt(r) with rsLoRA), the factor of B·A in W + B·A·scaling."""
    if not hasattr(model, "peft_config"):
        return {}
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    config = model.peft_config[adapter]
    if getattr(config, "use_dora", False):
        raise ValueError("LoRA weight sync: DoRA is not supported (plain LoRA factors only)")
    return {name: (float(m.scaling[adapter]), bool(getattr(m, "fan_in_fan_out", False)))
            for name, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A}  # fmt: skip


def _lora_module_of(name: str) -> str:
    """`a.b.q_proj.lora_A.default.weight` -> `a.b.q_proj`; a name of no LoRA part is returned as it is."""
    m = _LORA_PART.search(name)
    return name[: m.start()] if m else name


_WHOLE_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")


def hf_name(peft_name: str) -> str:
    """The HF checkpoint name (what vLLM loads) of a PEFT model's base parameter, or of the trained copy of a module
    that trains whole (`modules_to_save`, a reward model's score head)."""
    return _WHOLE_COPY.sub(".", peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."))


def merged_named_parameters(engine, changed_only: bool = False):
    """Yield (HF name, tensor) of the policy a LoRA actor computes, for weight sync: every LoRA linear's weight as
    W + B·A·scaling (its bias as it is), every other parameter as it is, under the names of the HF checkpoint. The
    merge is computed on copies (fp32, cast back to W's dtype): the trained module is never modified. Under ZeRO-3 a
    layer is gathered at a time (`full_named_parameters`; collective). `changed_only`: only the LoRA linears, the only
    weights training changes (the base is frozen), for engines that already hold the rest.
    A model without LoRA yields `full_named_parameters` (all of it, whatever `changed_only`)."""
    import itertools

    model = engine.module
    lora = lora_modules(model)
    if not lora:
        yield from full_named_parameters(engine)
        return
    adapter = model.active_adapter
    keep = (lambda n: _lora_module_of(n) in lora) if changed_only else None
    stream = full_named_parameters(engine, keep)
    for key, items in itertools.groupby(stream, key=lambda kv: _lora_module_of(kv[0])):
        parts = {n: t for n, t in items if ".original_module." not in n}  # a whole-trained module: its trained copy
        if key not in lora:
            yield from ((hf_name(n), t) for n, t in parts.items())
            continue
        scaling, fan_in_fan_out = lora[key]
        w = parts.pop(f"{key}.base_layer.weight")
        a, b = parts.pop(f"{key}.lora_A.{adapter}.weight"), parts.pop(f"{key}.lora_B.{adapter}.weight")
        delta = (b.float() @ a.float()) * scaling  # (out, r) @ (r, in)
        yield hf_name(f"{key}.weight"), (w.float() + (delta.T if fan_in_fan_out else delta)).to(w.dtype)
        yield from ((hf_name(n), t) for n, t in parts.items())  # the bias


def adapter_named_parameters(engine):
    """Yield (name, tensor) of the active LoRA adapter's factors under the names of a saved PEFT adapter
    (`base_model.model.<module>.lora_A.weight`), what vLLM's LoRA loader reads; the base weights are never gathered
    (ZeRO-3: only the factors, a layer at a time; collective)."""
    model = engine.module
    lora = lora_modules(model)
    assert lora, "adapter sync needs a PEFT LoRA model (--actor.model.lora-rank > 0)"
    adapter = model.active_adapter
    tag = f".{adapter}."
    for name, t in full_named_parameters(engine, keep=lambda n: ".lora_A." in n or ".lora_B." in n):
        yield name.replace(tag, "."), t


def adapter_config(model) -> dict:
    """The active adapter's PEFT config as the JSON of a saved adapter's `adapter_config.json`."""
    config = model.peft_config[model.active_adapter].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
