"""What only a GPU can show: DeepSpeed on CUDA (nccl), states moved off and back onto the GPU, packing under CUDA
kernels, and the weight transports between two processes. Skipped without CUDA (CI has none); run on a lent GPU by
results/gpu/run.sh, whose output is committed beside it. vLLM is not on that machine, so the engine side of a sync is
a replica model in a second process (tests/gpu_workers.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def random_examples(seed: int, n: int = 8, vocab: int = 100) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(4, 40)
        prompt = rng.randint(1, length - 1)
        out.append({"input_ids": [rng.randrange(4, vocab) for _ in range(length)],
                    "loss_mask": [0] * prompt + [1] * (length - prompt)})  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------ DeepSpeed on CUDA


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (2, "bf16"), (3, "bf16")])
def test_sft_trains_on_cuda_with_nccl(tmp_path, stage, dtype):
    """algos/sft.py on the GPU (DeepSpeed over nccl, world of one): the eval loss falls and the HF export (ZeRO-3
    parameters gathered) differs from the base model in every parameter."""
    import torch.distributed as dist

    from algos.sft import Args, main
    from core import models

    args = Args()
    args.model.name_or_path, args.model.dtype = "cleanrlhf/tiny", dtype
    args.ds.zero_stage = stage
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    args.eval.generate, args.eval.max_samples, args.eval.every = False, 64, 12
    args.train.warmup_steps, args.train.max_steps, args.train.batch_size = 0, 12, 32
    summary = main(args)
    assert dist.get_backend() == "nccl"
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 0.5, summary
    base = models.load_causal_lm(models.ModelConfig(name_or_path="cleanrlhf/tiny"))
    tuned = dict(models.load_causal_lm(models.ModelConfig(name_or_path=summary["export_dir"])).named_parameters())
    unchanged = [n for n, p in base.named_parameters() if torch.equal(p, tuned[n].to(p.dtype))]
    assert not unchanged, unchanged


def sft_learns_and_changes_every_parameter(tmp_path, dtype: str, **ds) -> None:
    """12 SFT steps of the tiny model on the GPU with the `--ds.*` settings `ds`: the eval loss falls by more than 0.5
    and every parameter of the HF export (ZeRO-3's gathered) differs from the base model's."""
    from algos.sft import Args, main
    from core import models

    args = Args()
    args.model.name_or_path, args.model.dtype = "cleanrlhf/tiny", dtype
    for key, value in ds.items():
        setattr(args.ds, key, value)
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    args.eval.generate, args.eval.max_samples, args.eval.every = False, 64, 12
    args.train.warmup_steps, args.train.max_steps, args.train.batch_size = 0, 12, 32
    summary = main(args)
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 0.5, summary
    base = models.load_causal_lm(models.ModelConfig(name_or_path="cleanrlhf/tiny"))
    tuned = dict(models.load_causal_lm(models.ModelConfig(name_or_path=summary["export_dir"])).named_parameters())
    unchanged = [n for n, p in base.named_parameters() if torch.equal(p, tuned[n].to(p.dtype))]
    assert not unchanged, unchanged


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (2, "bf16"), (3, "bf16")])
def test_sft_trains_with_muon_on_cuda(tmp_path, stage, dtype):
    """`--ds.optimizer muon` on the GPU (DeepSpeed's MuonWithAuxAdam, its kernels compiled there): the eval loss
    falls as with AdamW, and every parameter (Muon's matrices and AdamW's rest) changes."""
    sft_learns_and_changes_every_parameter(tmp_path, dtype, zero_stage=stage, optimizer="muon", grad_clip=0.0)


@pytest.mark.parametrize("stage", [1, 3])
def test_sft_trains_with_deepcompile_on_cuda(tmp_path, stage):
    """`--ds.deepcompile` (DeepSpeed's compiled ZeRO passes, CUDA only): the eval loss falls as it does without it,
    and every parameter of the export (ZeRO-3's gathered) changed."""
    sft_learns_and_changes_every_parameter(tmp_path, "bf16", zero_stage=stage, deepcompile=True)


def test_sft_trains_a_qwen2_05b_shaped_model_with_zero3(tmp_path, tokenizer):
    """The scale-up path: a randomly initialised Qwen2-0.5B-shaped model (24 layers, hidden 896, MLP 4864, the
    embedded tokenizer) saved as an ordinary HF folder and trained by algos/sft.py with ZeRO-3, bf16 and gradient
    checkpointing on one GPU: the training loss falls over 8 steps and the export loads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from algos.sft import Args, main
    from core import models

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = Args()
    args.model.name_or_path, args.model.dtype, args.model.gradient_checkpointing = str(tmp_path / "base"), "bf16", True
    args.ds.zero_stage = 3
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    args.eval.generate, args.eval.max_samples, args.eval.every = False, 64, 0
    args.train.warmup_steps, args.train.max_steps, args.train.batch_size, args.train.lr = 0, 8, 64, 3e-4
    summary = main(args)
    rows = [json.loads(line) for line in open(Path(args.run_dir) / "metrics.jsonl")]
    loss = {r["step"]: r["loss/sft"] for r in rows if "loss/sft" in r}
    assert loss[8] < loss[1] - 1.0, loss  # from ln(100) = 4.6 (uniform over the vocabulary) towards the digits
    print(f"0.5B-shaped SFT: {sum(p.numel() for p in Qwen2ForCausalLM(config).parameters()) / 1e6:.0f} M params, "
          f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, loss {loss[1]:.3f} -> {loss[8]:.3f}, "
          f"{rows[-1].get('perf/tokens_per_s', float('nan')):.0f} tokens/s")  # fmt: skip
    exported = models.load_causal_lm(models.ModelConfig(name_or_path=summary["export_dir"]))
    assert sum(p.numel() for p in exported.parameters()) > 300e6


def test_dpo_reaches_its_accuracy_goal_on_cuda(tmp_path):
    """algos/dpo.py's defaults (80 steps of 128 pairs from the warm start) on the GPU: held-out preference accuracy
    >= 90 %, as on CPU."""
    from algos.dpo import Args, EvalArgs, TrainArgs, main
    from core.config import LoggerConfig, ModelConfig

    args = Args(model=ModelConfig(name_or_path="cleanrlhf/tiny-sft"), train=TrainArgs(),
                eval=EvalArgs(every=40, max_samples=500), run_dir=str(tmp_path / "run"),
                logger=LoggerConfig(run_root=str(tmp_path), tensorboard=False, quiet=True))  # fmt: skip
    summary = main(args)
    assert summary["eval_pref_accuracy_last"] >= 0.9, summary


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_and_reload_states_free_the_gpu_and_change_nothing(tiny_path, stage):
    """The hybrid engine's DeepSpeed half: `placement.offload_states` frees most of the trainer's GPU memory, and
    after `reload_states` training goes on exactly as if nothing had moved (same parameters after the next step)."""
    from core import engine as ds_engine
    from core import packing, placement, weights
    from core.config import DSConfig
    from core.models import ModelConfig, load_causal_lm

    ds_engine.init_distributed()
    batch = packing.collate_packed(random_examples(0, n=16), device="cuda")

    def train(offload: bool) -> tuple[dict, list[int]]:
        torch.manual_seed(0)
        model = load_causal_lm(ModelConfig(name_or_path=str(tiny_path), dtype="bf16")).cuda()
        eng = ds_engine.make_engine(model, DSConfig(zero_stage=stage), lr=1e-3)
        mem = []
        for _ in range(3):
            loss = -(packing.token_logprobs(eng, batch) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            eng.backward(loss)
            eng.step()
            if offload:
                torch.cuda.synchronize()
                mem.append(torch.cuda.memory_allocated())
                placement.offload_states(eng)
                mem.append(torch.cuda.memory_allocated())
                placement.reload_states(eng)
        state = {k: v.float().cpu() for k, v in weights.full_named_parameters(eng)}
        eng.destroy()
        return state, mem

    plain, _ = train(offload=False)
    moved, mem = train(offload=True)
    numel = sum(p.numel() for p in plain.values())
    for before, after in zip(mem[::2], mem[1::2]):  # bf16 weights (2 B), fp32 master weights (4) and Adam moments (8)
        assert before - after >= 14 * numel, (mem, numel)
    for name, p in plain.items():
        torch.testing.assert_close(moved[name], p, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_packed_equals_padded_on_cuda(tiny_path, dtype, tol):
    """The padding-free forward under CUDA's sdpa kernels gives the padded forward's log-probs (fp32 within 1e-4;
    bf16 within 0.1, the bf16 rounding of a 1 M model's logits)."""
    from transformers import AutoModelForCausalLM

    from core import packing

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=dtype).cuda().eval()
    for seed in range(4):
        examples = random_examples(seed)
        packed = packing.collate_packed(examples, device="cuda")
        padded = packing.collate_padded(examples, 0, device="cuda")
        with torch.no_grad():
            lp_packed = packing.unpack(packing.token_logprobs(model, packed), packed["segments"])
            lp_padded = packing.token_logprobs(model, padded)
        for i, ex in enumerate(examples):
            torch.testing.assert_close(lp_packed[i].float(), lp_padded[i, : len(ex["input_ids"])].float(),
                                       rtol=0, atol=tol)  # fmt: skip


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_flex_attention_packed_one_row_equals_padded_sdpa_with_gradients_on_cuda(tiny_path, dtype, tol):
    """`--model.attn-implementation flex_attention` on CUDA: a micro-batch packed into one row (the layout sft.py and
    the RL scripts give it, `models.packs_in_one_row`) gives the padded sdpa forward's log-probs, and the SFT loss's
    gradients agree (fp32: within 1e-4 of the largest gradient; bf16 log-probs within its rounding, gradients not
    compared: two kernels' bf16 roundings)."""
    from transformers import AutoModelForCausalLM

    from core import packing

    flex = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=dtype, attn_implementation="flex_attention").cuda()
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=dtype, attn_implementation="sdpa").cuda()
    examples = random_examples(3, n=16)
    packed = packing.collate_packed(examples, device="cuda")
    padded = packing.collate_padded(examples, 0, device="cuda")
    lp_flex = packing.token_logprobs(flex, packed)
    lp_sdpa = packing.token_logprobs(sdpa, padded)
    for i, (ex, a) in enumerate(zip(examples, packing.unpack(lp_flex, packed["segments"]))):
        torch.testing.assert_close(a.float(), lp_sdpa[i, : len(ex["input_ids"])].float(), rtol=0, atol=tol)
    (-(lp_flex * packed["loss_mask"]).sum()).backward()
    (-(lp_sdpa * padded["loss_mask"]).sum()).backward()
    for (name, p), q in zip(flex.named_parameters(), sdpa.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if dtype == torch.float32:
            assert (p.grad - q.grad).abs().max() <= 1e-4 * q.grad.abs().max().clamp_min(1e-6), name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_rl_forward_logp_packed_chunked_equals_padded_full_logits_on_cuda(tiny_path, tokenizer, dtype, tol):
    """The RL scripts' forward (`core.rl.forward_logp`: packed rows, the chunked LM head on the generated positions)
    against the padded forward with the model's full logits, log-probs and entropies, gradients included in fp32."""
    from test_rl_packing import mixed_rollout

    from core import models, rl

    model = models.load_causal_lm(models.ModelConfig(name_or_path=str(tiny_path), dtype="fp32")).to(dtype).cuda()
    seqs = rl.sequences(mixed_rollout(len(tokenizer)), tokenizer.pad_token_id, torch.device("cuda"))
    out = {}
    for name, chunked, packed in (("fast", True, True), ("reference", False, False)):
        model.zero_grad()
        head = models.chunked_head
        if not chunked:
            models.chunked_head = lambda m: None
        try:
            logp, ent = rl.forward_logp(model, {**seqs, "packed": packed}, 0.8, entropy=True)
        finally:
            models.chunked_head = head
        (logp.sum() + 0.1 * ent.sum()).backward()
        out[name] = (logp.detach().float(), ent.detach().float(), [p.grad.float().clone() for p in model.parameters()])
    (lp, en, g), (lp0, en0, g0) = out["fast"], out["reference"]
    torch.testing.assert_close(lp, lp0, rtol=0, atol=tol)
    torch.testing.assert_close(en, en0, rtol=0, atol=tol)
    if dtype == torch.float32:
        for a, b in zip(g, g0):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------------------------- weight transport


def _spawn(target, *args):
    """A child process (spawn: CUDA cannot be forked) running `target(*args, inbox, outbox)`; waits for "ready"."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, inbox, outbox), daemon=True)
    proc.start()
    assert outbox.get(timeout=180) == "ready"
    return proc, inbox, outbox


def test_cuda_ipc_sync_round_trip_between_two_processes(tiny_path):
    """`share_bucket_ipc` -> another process on the same GPU (`open_bucket_ipc`), as a colocated engine receives
    weights: after each sync the replica's log-probs on fixed tokens equal the trainer's, and they change after a
    training step (the second sync really moved new weights). Small buckets, so a sync is many buckets."""
    from gpu_workers import model_receiver
    from transformers import AutoModelForCausalLM

    from core import packing
    from core.weight_sync import bucket_named_tensors, share_bucket_ipc

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).cuda()
    with torch.no_grad():  # start from weights the replica (loaded from tiny_path) does not have
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    proc, inbox, outbox = _spawn(model_receiver, str(tiny_path))
    tokens = [ex["input_ids"] for ex in random_examples(1, n=4)]
    batch = packing.collate_padded([{"input_ids": t, "loss_mask": [0] * len(t)} for t in tokens], 0, "cuda")

    def sync_and_compare() -> torch.Tensor:
        sent = 0
        for bucket in bucket_named_tensors(model.named_parameters(), bucket_mb=0.25):
            meta, handles, buffers = share_bucket_ipc(bucket, torch.float32, torch.device("cuda"))
            inbox.put(("bucket", meta, handles))
            answer = outbox.get(timeout=60)
            assert answer == len(meta), answer  # loaded (an error string otherwise)
            sent += answer
            del buffers  # only now: the replica has finished reading them
        assert sent == len(list(model.named_parameters()))
        inbox.put(("logprobs", tokens))
        theirs = outbox.get(timeout=60)
        assert isinstance(theirs, torch.Tensor), theirs
        with torch.no_grad():
            ours = packing.token_logprobs(model.eval(), batch).float().cpu()
        for i, t in enumerate(tokens):
            torch.testing.assert_close(theirs[i, 1 : len(t)], ours[i, 1 : len(t)], rtol=0, atol=1e-5)
        return ours

    try:
        first = sync_and_compare()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.train()
        train = packing.collate_packed(random_examples(2, n=16), device="cuda")
        loss = -(packing.token_logprobs(model, train) * train["loss_mask"]).sum() / train["loss_mask"].sum()
        loss.backward()
        opt.step()
        second = sync_and_compare()
        assert (second - first).abs().max() > 1e-3  # the replica now holds the trained weights
    finally:
        inbox.put(None)
        proc.join(timeout=30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
def test_nccl_broadcast_moves_buckets_between_two_gpus():
    """`init_weight_group("nccl")` + `send_bucket` / `receive_bucket` (`--vllm.sync-backend broadcast` on GPU) between
    a sender on cuda:0 and a receiver on cuda:1: every destination tensor holds what was sent."""
    from gpu_workers import buffer_receiver

    from core.engine import free_port
    from core.weight_sync import bucket_named_tensors, flatten_bucket, init_weight_group, send_bucket

    named = [(f"model.layers.{i}.w", torch.randn(256, 256, device="cuda:0", dtype=torch.bfloat16)) for i in range(8)]
    spec = [(n, "bfloat16", tuple(t.shape)) for n, t in named]
    proc, inbox, outbox = _spawn(buffer_receiver, spec)
    try:
        port = free_port()
        inbox.put(("group", "nccl", "127.0.0.1", port, "cuda:1"))
        group = init_weight_group("nccl", "127.0.0.1", port, 0, 2, 120)
        assert outbox.get(timeout=120) == "joined"
        for bucket in bucket_named_tensors(named, bucket_mb=0.3):
            meta, flats = flatten_bucket(bucket, torch.bfloat16, torch.device("cuda:0"))
            inbox.put(meta)
            send_bucket(group, flats, 120)
            assert outbox.get(timeout=120) == "ok"
        inbox.put(None)
        inbox.put(("checksum",))
        assert outbox.get(timeout=60) == pytest.approx(sum(t.double().sum().item() for _, t in named), rel=1e-9)
    finally:
        inbox.put(None)
        proc.join(timeout=30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
def test_expert_parallel_engine_over_nccl_trains_like_data_parallel(tmp_path):
    """DeepSpeed AutoEP (`--ds.expert-parallel-size 2`) over NCCL: tests/expert_parallel_worker.py on 2 GPUs in bf16
    (the GPU's default dtype; AutoEP's experts run `torch._grouped_mm`, whose CUDA kernel takes bf16 only), EP=2
    against the same 2 ranks holding every expert, 3 AdamW steps at ZeRO 0, 2 and 3 (the CPU test,
    tests/test_expert_parallel.py, checks fp32 over gloo to float32 rounding): one gradient norm on both ranks, the
    losses and norms of EP=1 within bf16's rounding of a forward (AutoEP's grouped matmul and transformers' per-expert
    loop round at other places), every tensor trained, the whole weights under the HF names and shapes."""
    import os
    import subprocess
    import sys

    from core import embedded
    from core.engine import free_port

    embedded.ensure_tiny_moe()
    out = tmp_path / "results.json"
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).with_name("expert_parallel_worker.py")), str(out),
           "auto", "bf16"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    base = results.pop("base")
    for case, r in results.items():
        one, ep = r["ep1"], r["ep2"]
        for step in range(3):
            assert len(set(ep["norms"][step])) == 1, (case, step, ep["norms"])
            assert ep["loss"][step] == pytest.approx(one["loss"][step], rel=2e-2), (case, step)
            assert ep["norms"][step][0] == pytest.approx(one["norms"][step][0], rel=5e-2), (case, step)
        assert ep["state"] == {k: v for k, v in base.items() if k != "lm_head.weight"}, case
        assert ep["sync_names"] == one["sync_names"] and ep["moved"] > 0, case
