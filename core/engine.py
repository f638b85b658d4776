"""DeepSpeed plumbing: process group, ZeRO config, engine with AdamW and the caller's lr schedule, HF export.
The weights read out whole for sync and export are in `core.weights`, the optimizers other than torch's AdamW in
`core.optimizers`, the EMA of the weights in `core.ema`.

Tested with deepspeed 0.19.8 and torch 2.13 (gloo on CPU; nccl on CUDA). One process (`python algos/x.py`), several
with `torchrun --nproc_per_node N algos/x.py` or the `deepspeed` launcher, or inside Ray actors that set
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import socket
import sys
import time
import types
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from core import models
from core.config import DSConfig, RefConfig, expert_parallel_flag_errors
from core.ema import ema_init, ema_update, ema_weights
from core.models import TokenValues
from core.optimizers import fused_adam, muon_optimizer
from core.weights import ep_sharded, ep_size, gathered_state_dict, merged_named_parameters, tp_sharded, tp_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compiling() -> bool:
    """Whether a compiler or ninja runs on this machine (a JIT build of an op in progress)."""
    import psutil

    for proc in psutil.process_iter(["name"]):
        if (proc.info["name"] or "") in ("ninja", "cc1plus", "c++", "g++", "gcc", "ld", "collect2"):
            return True
    return False


def clear_stale_build_lock(name: str = "deepspeed_shm_comm", max_age_s: float = 900,
                           idle_age_s: float = 180) -> Path | None:  # fmt: skip
    """DeepSpeed builds its CPU shared-memory collectives op just in time (`deepspeed_shm_comm`, once per machine)
    under torch's file baton: a `lock` file that other processes wait on, with no time limit, until it is gone. A
    process killed while it held the lock leaves the file, and every later run then hangs in `init_distributed`. A
    lock older than `max_age_s`, or older than `idle_age_s` while no compiler runs on this machine (a build takes
    about a minute of compiling), is removed with a warning naming it; returns its path."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions",
        f"py{sys.version_info.major}{sys.version_info.minor}_{'cu' if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    lock = Path(root) / name / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age <= idle_age_s or (age <= max_age_s and _compiling()):
        return None
    lock.unlink(missing_ok=True)
    print(f"[cleanrlhf] removed {lock}, left {age / 60:.0f} min ago by a process killed while building DeepSpeed's "
          f"{name} op (every start would have waited on it forever)", file=sys.stderr, flush=True)  # fmt: skip
    return lock


def _destroy_world() -> None:
    """At exit, release the world while the interpreter is whole. Left to interpreter finalization, gloo's worker
    threads can still hold work whose tensors need the GIL, and a rank dies with SIGABRT ("terminate called without
    an active exception") after its last line ran: a finished `torchrun` job then fails."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # exiting anyway: say so, do not mask the exit status
            print(f"[cleanrlhf] destroy_process_group at exit: {e}", file=sys.stderr, flush=True)


_one_process = False  # this process made its own world of one (a plain `python algos/x.py`): no launcher's env


_stores: dict[int, dist.TCPStore] = {}  # MASTER_PORT -> the loopback store of this process's worlds of one


def _loopback_store(port: int, timeout_s: int) -> dist.TCPStore:
    """The store of a one-process world, listening on 127.0.0.1:`port` only. torch's `env://` store listens on every
    interface whatever MASTER_ADDR says (torch 2.13: `*:<MASTER_PORT>`), opening a port to the network for a world no
    other process joins; a socket bound here and handed over (`master_listen_fd`, as vLLM does) keeps it local. A
    later world of this process on the same port (the last one destroyed by an in-process vLLM engine, or a next
    run) gets the same store, as `env://` shares one server per port in a process."""
    if port in _stores:
        return _stores[port]
    _stores.clear()  # a store on another port: closed once nothing else holds it
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError as e:
        sock.close()
        raise ValueError(f"MASTER_PORT {port}: cannot listen on 127.0.0.1:{port} for this run's process group ({e}); "
                         "unset MASTER_PORT (a free port is picked) or give a free one") from None  # fmt: skip
    fd = sock.detach()
    try:
        store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=timeout_s), master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise
    _stores[port] = store
    return store


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> tuple[int, int, torch.device]:
    """Join (or create, for a plain `python` run) the torch.distributed world; returns (rank, world_size, device).

    Collectives time out after `timeout_s`, so a dead rank is an error, not a hang. With several ranks on one CPU
    box each process gets its share of the cores (oversubscribed threads make steps 10x slower)."""
    import deepspeed

    global _one_process
    if "RANK" not in os.environ:  # single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        _one_process = True
    local_rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    elif world > 1 and "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # The world may have been torn down by someone else in this process (an in-process vLLM engine destroys it at
    # shutdown, and the next in-process engine makes a new one), and DeepSpeed would keep handing out the dead groups
    # it cached over the old world (tested with deepspeed 0.19.8). Comparing worlds missed a case (an agent-file GRPO
    # run after other in-process runs failed with "Group ... is not registered"), so a script's start always releases
    # them: no engine of this script exists yet, and DeepSpeed rebuilds what it needs.
    from deepspeed.utils import groups

    if hasattr(groups, "_release_process_group_references"):
        groups._release_process_group_references(None)
    import deepspeed.comm as ds_comm

    if not dist.is_initialized() or not ds_comm.is_initialized():  # a world of someone else's: DeepSpeed wraps it
        if not dist.is_initialized() and not torch.cuda.is_available():
            clear_stale_build_lock()
        if not dist.is_initialized() and _one_process and world == 1:  # a world of ours: its store on loopback only
            dist.init_process_group(backend, store=_loopback_store(int(os.environ["MASTER_PORT"]), timeout_s), rank=0,
                                    world_size=1, timeout=timedelta(seconds=timeout_s))  # fmt: skip
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), auto_mpi_discovery=False)
    atexit.unregister(_destroy_world)  # once, however many times a process (re)joins a world
    atexit.register(_destroy_world)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def zero_stage(ds: DSConfig, hybrid: bool = False) -> int:
    """`--ds.zero-stage`, or its default for this world: 3 to offload parameters, 2 with several ranks, an offloaded
    optimizer or a hybrid engine (`--vllm.enable-sleep`: DeepSpeed moves the states of ZeRO ≥ 1 only), else 0 (one
    process gains nothing from sharding)."""
    import torch.distributed as dist

    if ds.zero_stage is not None:
        return ds.zero_stage
    world = dist.get_world_size() if dist.is_initialized() else 1
    return 3 if ds.offload_params else 2 if world > 1 or ds.offload_optimizer or hybrid else 0


def ds_config(ds: DSConfig, dtype: torch.dtype, stage: int, model_type: str | None = None) -> dict:
    """The DeepSpeed config dict (`model_type`: the HF model's, which picks AutoEP's preset). Micro-batching and
    gradient accumulation are done by the scripts (packed micro-batches vary in number), so DeepSpeed sees micro-batch
    1, accumulation 1, and `set_gradient_accumulation_boundary` marks the last micro-batch of a step."""
    zero: dict = {"stage": stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if ds.optimizer == "muon":
        zero["reduce_scatter"] = False  # DeepSpeed 0.19.8's ZeRO-3 refuses Muon with it; tested off at 0-3
    compiled = {"compile": {"deepcompile": True}} if ds.deepcompile else {}  # its passes run at engine.compile()
    if ds.tensor_parallel_size > 1:  # AutoTP: DeepSpeed shards the linears at initialize (see tp_data_split)
        compiled["tensor_parallel"] = {"autotp_size": ds.tensor_parallel_size, "vocab_parallel_lm_head": False}
    if ds.expert_parallel_size > 1:  # AutoEP: DeepSpeed swaps each MoE block for its own at initialize
        compiled["expert_parallel"] = {"enabled": True, "autoep_size": ds.expert_parallel_size}
        if model_type in EXPERT_PARALLEL_MODELS:
            compiled["expert_parallel"]["preset_model"] = EXPERT_PARALLEL_MODELS[model_type]
    return compiled | {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # a stage-0 fp32 engine computes the gradient norm only when it clips (see make_engine): clip at ∞ then
        "gradient_clipping": ds.grad_clip or (math.inf if stage == 0 and dtype != torch.bfloat16 else 0.0),
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,  # torch AdamW on CPU (see make_engine)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def tp_data_split(ds: DSConfig, sp_size: int = 1) -> tuple[int, int]:
    """This rank's (data-parallel rank, data-parallel world) under `--ds.tensor-parallel-size N` (DeepSpeed AutoTP):
    the N consecutive ranks of a tensor-parallel group (DeepSpeed's (data, tensor) mesh: ranks r with the same
    r // N) compute every forward and backward together, so they take the same samples, and the data is split over
    the groups. N = 1: (rank, world). Refuses an N that does not divide the world, and N > 1 with `--train.sp-size`
    (`sp_size` > 1: both would split the ranks into groups of their own)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = ds.tensor_parallel_size
    if tp == 1:
        return rank, world
    if sp_size > 1:
        raise ValueError(f"--ds.tensor-parallel-size {tp} with --train.sp-size {sp_size}: tensor and sequence "
                         "parallelism together are not built; use one of them")  # fmt: skip
    if world % tp:
        raise ValueError(f"--ds.tensor-parallel-size {tp}: must divide the number of ranks ({world})")
    return rank // tp, world // tp


def forwards_in_step(engine) -> bool:
    """Whether every forward of `engine`'s model is a collective that all ranks must run the same number of times,
    although each rank has its own samples: ZeRO-3 over several ranks (each layer's parameters are gathered) and AutoEP
    (`--ds.expert-parallel-size`: tokens travel to their experts' ranks). HF `generate` then needs `synced_gpus`, which
    keeps a rank that has finished stepping until every rank has."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    return several and (engine.zero_optimization_stage() == 3 or ep_size(engine) > 1)


def tp_group_size() -> int:
    """Ranks per tensor-parallel group of this process's trainer world: `--ds.tensor-parallel-size` once an AutoTP
    engine was built here (DeepSpeed keeps its groups per process; the next script's `init_distributed` releases
    them), else 1. The RL plumbing reads it where the ranks of a group share their rows (`core.rl.minibatches`)."""
    from deepspeed.utils import groups

    group = getattr(groups, "_TENSOR_MODEL_PARALLEL_GROUP", None)
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _tp_clip_and_keep_norm(engine, max_norm: float) -> torch.Tensor:
    """Global gradient norm of a stage-0 AutoTP or AutoEP engine, and clipping by it: every rank of a tensor-parallel
    group holds a shard's gradient of each sharded weight (of an expert-parallel group: its own experts' gradients)
    and a whole copy of the replicated ones' (norms, row-parallel biases; attention, router, shared expert), so the
    shards' squares are summed over the group and the replicated ones counted once. Every rank gets the same norm,
    hence the same clip coefficient (a rank-local norm would clip the replicas differently and drift them apart)."""
    from deepspeed.utils import groups

    if ep_size(engine) > 1:  # AutoEP: the experts' group (its ranks hold different experts), DeepSpeed's name for it
        owns, group = ep_sharded, groups._get_expert_parallel_group(f"ep_size_{ep_size(engine)}")
    else:
        owns, group = tp_sharded, groups.get_tensor_model_parallel_group()
    params = [p for p in engine.module.parameters() if p.grad is not None]
    sharded = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params if owns(p)]
    whole = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params if not owns(p)]
    sq = torch.stack(sharded).pow(2).sum() if sharded else torch.zeros(())
    dist.all_reduce(sq, group=group)
    if whole:
        sq = sq + torch.stack(whole).pow(2).sum()
    norm = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile would use on CPU (`$CXX`, else g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


# the MoE families whose DeepSpeed 0.19.8 AutoEP preset keeps the experts as fused 3-D tensors, which
# `core.weights.ep_hf_named` maps back to the HF names (model_type: preset)
EXPERT_PARALLEL_MODELS = {"qwen2_moe": "qwen3_moe", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}


def check_expert_parallel(model, ds: DSConfig) -> None:
    """Refuse `--ds.expert-parallel-size N` for a model or world AutoEP does not split here, before DeepSpeed starts:
    the flag combinations of `expert_parallel_flag_errors`, a dense model, a family outside `EXPERT_PARALLEL_MODELS`,
    a scalar-head model (rm.py, ppo.py's critic), and an N that does not divide the ranks or the experts."""
    n = ds.expert_parallel_size
    flag = f"--ds.expert-parallel-size {n}"
    wrapped = types.SimpleNamespace(lora_rank=int(hasattr(model, "peft_config")), load_in_4bit=models.is_4bit(model))
    errors = expert_parallel_flag_errors(ds, model=wrapped)
    if errors:
        raise ValueError(errors[0])
    if isinstance(model, TokenValues):
        raise ValueError(f"{flag} with a scalar-head model (rm.py; ppo.py's critic, built with the same --ds.* flags): "
                         "expert parallelism is built for causal LMs (sft.py, dpo.py, the RL actor)")  # fmt: skip
    config = model.config
    if not models.is_moe(model):
        raise ValueError(f"{flag} with a dense model (--model.name-or-path / --actor.model.name-or-path: "
                         f"model_type {config.model_type} has no experts)")  # fmt: skip
    if config.model_type not in EXPERT_PARALLEL_MODELS:
        raise ValueError(f"{flag} with model_type {config.model_type} (--model.name-or-path / "
                         f"--actor.model.name-or-path): built for {', '.join(EXPERT_PARALLEL_MODELS)}")  # fmt: skip
    world = dist.get_world_size() if dist.is_initialized() else 1
    experts = next(getattr(config, k) for k in ("num_experts", "num_local_experts") if hasattr(config, k))
    if world % n or experts % n:
        raise ValueError(f"{flag}: must divide the number of ranks ({world}) and of experts ({experts})")


def make_engine(model, ds: DSConfig, lr: float, schedule: Callable[[int], float] | None = None, *,
                weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), hybrid: bool = False,
                ema_beta: float = 0.0):  # fmt: skip
    """Wrap `model` in a DeepSpeed engine with AdamW over its trainable parameters (DeepSpeed's FusedAdam on CUDA,
    torch's on CPU; `--ds.optimizer muon`: `muon_optimizer`) at peak lr `lr`, and the caller's learning-rate schedule:
    `schedule(update)`, the peak lr's multiplier at each optimizer step (every training script passes its own
    `lr_schedule`; None: a constant lr, for tests and benchmarks). `hybrid`: the engine's
    states will be moved off the GPU while vLLM generates (`core.placement.offload_states`). `ema_beta` > 0: keep an
    EMA of the weights (`ema_init`). Returns the engine; `engine.module` is the model, `engine.lr_scheduler` the
    schedule."""
    import deepspeed

    stage = zero_stage(ds, hybrid)
    if stage == 3 and models.is_4bit(model):
        raise ValueError("--model.load-in-4bit with ZeRO-3 (--ds.zero-stage 3, or its offload-params): DeepSpeed "
                         "cannot partition bitsandbytes' 4-bit weights; QLoRA runs at ZeRO 0-2 (the frozen 4-bit base "
                         "is small, and ZeRO-2 still shards the adapters' optimizer states)")  # fmt: skip
    if hybrid and stage == 0 and torch.cuda.is_available():
        raise ValueError("--vllm.enable-sleep with --ds.zero-stage 0: DeepSpeed cannot move a stage-0 engine's states "
                         "off the GPU; use --ds.zero-stage 2 or 3 (the default picks 2)")  # fmt: skip
    if ds.tensor_parallel_size > 1:
        if hasattr(model, "peft_config") or models.is_4bit(model):
            raise ValueError(f"--ds.tensor-parallel-size {ds.tensor_parallel_size} with LoRA or 4-bit weights "
                             "(--model.lora-rank / --model.load-in-4bit; --actor.model.lora-rank / "
                             "--actor.model.load-in-4bit in the RL scripts): AutoTP shards plain linear layers, not "
                             "PEFT's or bitsandbytes' wrappers; train the full model, or LoRA without tensor "
                             "parallelism")  # fmt: skip
        if ds.optimizer == "muon":
            raise ValueError(f"--ds.tensor-parallel-size {ds.tensor_parallel_size} with --ds.optimizer muon: Muon "
                             "orthogonalises whole matrices, and AutoTP leaves each rank a shard")  # fmt: skip
        tp_data_split(ds)  # refuses a size that does not divide the ranks
    if ds.expert_parallel_size > 1:
        check_expert_parallel(model, ds)
    if ds.optimizer == "muon" and stage > 0 and ds.grad_clip > 0:
        raise ValueError(f"--ds.optimizer muon at ZeRO-{stage} with --ds.grad-clip {ds.grad_clip}: DeepSpeed 0.19.8 "
                         "orthogonalises the Muon matrices' gradients before it clips, so it would clip the updates "
                         "(norm ~50 for the tiny model) and shrink every step; pass --ds.grad-clip 0 (Muon's update "
                         "does not depend on the gradient's scale) or --ds.zero-stage 0")  # fmt: skip
    dtype = next(model.parameters()).dtype

    def adamw(params: list):  # a list of tensors, or of param groups
        optimizer = (
            fused_adam(params, lr, betas, weight_decay)
            if torch.cuda.is_available() and not ds.offload_optimizer
            else None
        )
        # CPU: torch AdamW (no 2-4 min CPUAdam compile; the models that train on CPU are small), fused: one kernel
        # over all tensors, 0.8 ms against 5-7 ms per step for the 1 M tiny model
        return optimizer or torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)

    def lambda_lr(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule or (lambda update: 1.0))

    if ds.expert_parallel_size > 1:
        # AutoEP replaces each MoE block inside `initialize`: DeepSpeed builds the optimizer afterwards from these
        # callables, over the replaced model's parameters, the experts in param groups of their own (`"moe": True`,
        # which DeepSpeed's ZeRO-1/2 optimizer requires of a model with expert-parallel layers)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as moe_groups

        def optimizer(params):
            return adamw(moe_groups({"params": [p for p in params if p.requires_grad], "name": "params"}))

        scheduler = lambda_lr
    else:
        optimizer = muon_optimizer(model, ds, lr, betas, weight_decay) if ds.optimizer == "muon" else None
        optimizer = optimizer or adamw([p for p in model.parameters() if p.requires_grad])
        scheduler = lambda_lr(optimizer)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    config = ds_config(ds, dtype, stage, model_type)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if stage == 0 and dtype != torch.bfloat16:
        # DeepSpeed clips a stage-0 fp32 engine's (already all-reduced) gradients but drops their norm, so
        # get_global_grad_norm() would be None: clip here and keep the norm, as its ZeRO and bf16 optimizers do
        def clip_and_keep_norm():
            if tp_size(engine) > 1 or ep_size(engine) > 1:  # a TP or EP group's shards make one gradient: one norm
                engine._global_grad_norm = _tp_clip_and_keep_norm(engine, ds.grad_clip or math.inf)
                return
            # the norm `optimizer_step` computed for its NaN/inf check, else computed here (one pass either way)
            norm, engine.cleanrlhf_norm = engine.cleanrlhf_norm, None
            if norm is None:
                norm = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters() if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_(engine.module.parameters(), ds.grad_clip or math.inf, norm)
            engine._global_grad_norm = norm

        engine.clip_fp32_gradients = clip_and_keep_norm
        engine.cleanrlhf_norm = None  # set by `optimizer_step`, taken by the clip of the `engine.step()` it calls
        if not dist.is_initialized() or dist.get_world_size() == 1:
            engine.enable_backward_allreduce = False  # a world of one: its "all-reduce" only flattens and copies back
    if ds.compile or ds.deepcompile:  # DeepCompile's passes are installed by the same engine.compile()
        if not torch.cuda.is_available() and cpp_compiler() is None:
            raise ValueError("--ds.compile on CPU needs a C++ compiler (torch.compile writes C++ kernels): install "
                             "g++ or set CXX, or leave --ds.compile off")  # fmt: skip
        engine.compile()  # compiles engine.module in place (nn.Module.compile): parameter names stay as they are
    if ema_beta > 0:
        ema_init(engine, ema_beta)
    return engine


def make_frozen(model, cfg: RefConfig, device: torch.device):
    """A model for forward passes only (the reference policy of the KL term), placed as `cfg` says: the plain model on
    `device` (zero_stage 0), in CPU memory to be moved by `on_device` (0 + offload), or a DeepSpeed ZeRO-3 engine
    with no optimizer whose parameters are partitioned over the ranks of the current world (3; + offload: the
    shards in CPU memory). Either way `frozen(input_ids=..., attention_mask=...)` returns the model's output."""
    import deepspeed

    model.eval().requires_grad_(False)
    if cfg.zero_stage == 3 and models.is_4bit(model):
        raise ValueError("a 4-bit frozen model (--ref.load-in-4bit, --teacher.load-in-4bit) with zero-stage 3: "
                         "DeepSpeed cannot partition bitsandbytes' 4-bit weights; use zero-stage 0 (the 4-bit model "
                         "is whole on every rank, at about a quarter of its 16-bit size)")  # fmt: skip
    if cfg.zero_stage == 0:
        return model.to("cpu" if cfg.offload and device.type != "cpu" else device)
    zero: dict = {"stage": 3}
    if cfg.offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": next(model.parameters()).dtype == torch.bfloat16},
        "steps_per_print": 10**12,
    }
    # After an AutoTP engine (`--ds.tensor-parallel-size`) DeepSpeed's process-wide groups are its (data, tensor)
    # mesh, and an engine built without them fails (deepspeed 0.19.8 asks a missing mpu for its model-parallel rank):
    # hand it those groups. Its partitions then span the data-parallel ranks, and the ranks of a TP group, which
    # forward the same rows, each hold the same partition.
    from deepspeed.utils import groups

    mpu = groups if tp_group_size() > 1 else None
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    engine.eval()
    return engine


@contextmanager
def on_device(model, device: torch.device):
    """Within the block, an offloaded frozen model (`make_frozen` with zero_stage 0 + offload) sits on `device`; it
    goes back to CPU memory after. No-op for None, DeepSpeed engines and models already on `device`."""
    home = None
    if model is not None and not hasattr(model, "zero_optimization_stage"):
        home = next(model.parameters()).device
        if home == device:
            home = None
        else:
            model.to(device)
    try:
        yield model
    finally:
        if home is not None:
            model.to(home)


def all_reduce(x: float | int | torch.Tensor, op: str = "sum") -> float:
    """Reduce a Python number over all ranks (sum or max) and return it as a float."""
    t = torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.item()


def check_finite(loss: torch.Tensor, step: int, what: str = "loss") -> None:
    """Raise FloatingPointError naming `what` and `step` when `loss` holds a NaN or inf. Call it before the loss's
    backward: the optimizer step is then never taken and the weights stay as they were."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise FloatingPointError(f"non-finite {what} ({loss.detach().float().sum().item()}) at step {step}: "
                                 f"stopped before the optimizer step, weights untouched")  # fmt: skip


def _local_grads(engine):
    """This rank's share of the gradients the next `engine.step()` applies, and whether the shares of the ranks are
    disjoint (ZeRO ≥ 1: add them up) or copies of one full gradient (ZeRO-0: every rank holds it all-reduced).

    Where DeepSpeed 0.19.8 keeps them after the last backward of a step (`deepspeed.utils.safe_get_full_grad` reads
    the same places, then gathers them over the ranks, a collective per parameter):
      ZeRO-3: `deepspeed.utils.safe_get_local_grad`, this rank's fp32 partition (offloaded: copied from CPU memory);
      ZeRO-1/2: the fragment of the parameter this rank owns, `param._hp_mapping.get_lp_grad_fragment(...)`, a view
        into the optimizer's `averaged_gradients` (offloaded: its fp32 gradient partition in CPU memory); None for
        parameters owned wholly by other ranks (`param.grad` has been freed by then);
      ZeRO-0: the bf16 optimizer's fp32 accumulation buffer `param._hp_grad`, else `param.grad` (fp32, torch AdamW).
    """
    stage = engine.zero_optimization_stage()
    grads = []
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        if stage == 3:
            from deepspeed.utils import safe_get_local_grad

            g = safe_get_local_grad(p)
        elif stage in (1, 2):
            mapping = getattr(p, "_hp_mapping", None)
            g = None if mapping is None else mapping.get_lp_grad_fragment(p._index_in_param_group)
        else:
            g = getattr(p, "_hp_grad", None)
            g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    return grads, stage > 0


def grad_norm(engine) -> float:
    """Global L2 norm of the gradients that the next `engine.step()` applies; call after the last backward of a step
    (the one with the accumulation boundary). NaN or inf when any gradient element is, or when the norm overflows
    fp32 (DeepSpeed computes it in fp32 too). Collective: every rank must call it. Tested with deepspeed 0.19.8 at
    ZeRO-0/1/2/3 (see `_local_grads` for where each stage keeps them)."""
    grads, sharded = _local_grads(engine)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # per-tensor norms first (where the tensor lives: an offloaded partition stays in CPU memory), then their squares
    # summed in fp32, as DeepSpeed's ZeRO optimizers compute the norm they clip with
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32).to(device) for g in grads]
    sq = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        if not sharded:  # every rank holds the same full gradient: count it once (NaN or inf · 0 stays NaN)
            sq = sq * float(dist.get_rank() == 0)
        dist.all_reduce(sq)
    return float(sq.sqrt())


def optimizer_step(engine, step: int, name: str = "model") -> float:
    """`engine.step()`, unless a gradient is NaN/inf on any rank: then raise FloatingPointError naming `name` (e.g.
    actor, critic) and `step`, before the optimizer touches the weights. Call after the last backward of the step, on
    every rank (collective). Returns DeepSpeed's gradient norm of the step (0.0 where it keeps none)."""
    grads, _ = _local_grads(engine)
    # One read of the gradients (they are the size of the model): a stage-0 fp32 engine's clip norm, computed here and
    # handed to its clip (`make_engine`), else each tensor's largest |element|. Either is NaN/inf when an element is.
    clips_here = hasattr(engine, "cleanrlhf_norm") and tp_size(engine) == 1 and ep_size(engine) == 1
    if clips_here:
        norm = torch.nn.utils.get_total_norm([g.detach() for g in grads])
        bad = float(not bool(torch.isfinite(norm)))
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        peaks = [torch.linalg.vector_norm(g.detach(), float("inf")).float().to(device) for g in grads]
        bad = float(bool(peaks) and not bool(torch.isfinite(torch.stack(peaks)).all()))
    if all_reduce(bad) > 0:
        raise FloatingPointError(f"non-finite gradient of the {name} at step {step} (a NaN or inf element, or a norm "
                                 f"past the float range): stopped before the optimizer step, weights untouched")  # fmt: skip
    if clips_here:
        engine.cleanrlhf_norm = norm
    engine.step()
    ema_update(engine)  # `--actor.ema-beta`: the moving average follows every optimizer step
    return float(engine.get_global_grad_norm() or 0.0)


def check_weights_finite(engine, step: int, name: str = "model") -> None:
    """Raise FloatingPointError naming `name` and `step` when a trainable weight is NaN/inf on any rank (each rank
    checks the parameters it holds: its ZeRO-3 partition, or the full tensors). Call before saving a checkpoint, so
    that no checkpoint ever holds non-finite weights. Collective: every rank must call it."""
    bad = torch.zeros((), dtype=torch.float64)
    for p in engine.module.parameters():
        t = (
            p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p
        )  # ZeRO-3: this rank's partition (offloaded: on CPU)
        if p.requires_grad and t.numel() and not bool(torch.isfinite(t.detach()).all()):
            bad += 1
    if all_reduce(bad) > 0:
        raise FloatingPointError(f"non-finite weights in the {name} after step {step}: no checkpoint written")


class AdaptersOff:
    """A LoRA actor engine seen with its adapters switched off: every call runs the engine's forward inside PEFT's
    `disable_adapter()`, so it computes the frozen base model, the reference policy of the KL term, without a second
    copy of the weights. Other attributes are the engine's (`module`, `zero_optimization_stage`, ...), so the
    log-prob code that takes a DeepSpeed engine takes this too. Under ZeRO-3 its forward is a collective like the
    actor's."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, *args, **kwargs):
        with self.engine.module.disable_adapter():
            return self.engine(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)


@contextmanager
def _no_hf_progress_bars():
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def export_hf(engine, tokenizer, out_dir: str | Path, ema: bool = False) -> None:
    """Save an HF model folder (config, safetensors, tokenizer; a vision-language model's image processor, read from
    the folder it was loaded from) that `from_pretrained` and vLLM load. LoRA adapters
    are merged into the base weights. Written to a temporary folder and renamed: a kill never leaves a half export.
    Collective: call on every rank. Refuses (FloatingPointError naming `out_dir`) weights holding a NaN or inf.
    `ema`: export the engine's EMA weights (`ema_init`) instead of the trained ones."""
    out_dir = Path(out_dir)
    four_bit = models.is_4bit(engine.module)
    with ema_weights(engine) if ema else contextlib.nullcontext():
        state = gathered_state_dict(engine)
        if four_bit and state is not None:  # QLoRA: the dequantized base with the adapters merged (make_engine refuses
            # ZeRO-3, so this is no collective); a scalar-head model's PEFT model sits inside TokenValues
            peft = engine.module.model if isinstance(engine.module, TokenValues) else engine.module
            state = dict(merged_named_parameters(types.SimpleNamespace(module=peft, zero_optimization_stage=lambda: 0)))
    bad = [k for k, v in (state or {}).items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if all_reduce(len(bad)) > 0:  # every rank raises, not only rank 0, which holds the gathered weights
        raise FloatingPointError(
            f"{out_dir}: not exported, non-finite weights" + (f" in {', '.join(bad[:5])}" if bad else "")
        )
    if dist.get_rank() == 0:
        model = engine.module
        if isinstance(model, TokenValues):  # a trained scalar-head model: export the HF model inside
            model = model.model
            if not four_bit:  # (a 4-bit one's merged state is already under its HF names)
                state = {k.removeprefix("model."): v for k, v in state.items()}
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if four_bit:  # a plain HF model in the compute dtype, without the 4-bit quantization config
            model = model.get_base_model()
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            model = type(model)._from_config(type(model.config).from_dict(config),
                                             dtype=next(iter(state.values())).dtype)  # fmt: skip
        elif ep_size(engine) > 1:  # AutoEP's blocks in the trained model: an HF model of its config saves the state
            model = type(model)._from_config(model.config, dtype=next(iter(state.values())).dtype)
        elif hasattr(model, "peft_config"):  # rebuild base + adapters from the gathered weights, then merge
            from peft import get_peft_model

            base = type(model.get_base_model())._from_config(model.get_base_model().config)  # causal LM or scalar head
            fresh = get_peft_model(base, model.peft_config["default"])
            fresh.load_state_dict(state)
            model = fresh.merge_and_unload()
            state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            # a tied head saved as its own tensor loads untied in vLLM, and a weight sync (which sends the shared
            # tensor once, as embed_tokens) would then leave the engine's head stale
            state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
        with _no_hf_progress_bars():  # a tqdm bar per save would cut through the run's rich progress bar
            model.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        if getattr(model.config, "vision_config", None) is not None:  # a vision-language model: its image processor
            from transformers import AutoImageProcessor

            AutoImageProcessor.from_pretrained(model.name_or_path).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier()
