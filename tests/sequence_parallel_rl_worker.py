"""One GRPO update (2 minibatches x 2 epochs, KL to a ZeRO-3 reference, entropy bonus), one REINFORCE++ update and
one PPO update (a ZeRO-3 critic's values, GAE, the critic's and the actor's steps) on a fixed rollout, under `torchrun --nproc_per_node N`: N = 1 plain, N = 2 with `--train.sp-size 2` (one SP group: both
ranks train on every sequence, each forwarding half of every packed row). The actor is a DeepSpeed ZeRO-3 engine
(fp32, gloo) built from the same seed in both. Rank 0 writes the update metrics (losses, KL, entropy, gradient
norms of all four optimizer steps) as JSON to argv[1]; tests/test_sequence_parallel.py compares N = 2 with N = 1."""

import json
import random
import sys
from types import SimpleNamespace

import torch

from agents.executor import Episode
from algos import grpo, ppo, reinforce_pp
from core import embedded, models, rl
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig, RefConfig


def rollout(vocab: int, n: int = 8) -> list[Episode]:
    rng = random.Random(0)
    episodes = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 7, 20, 45]))]
        episodes.append(Episode({}, prompt, response, [-2.0] * len(response), [1] * len(response), False))
    return episodes


def main(out: str) -> None:
    rank, world, device = ds_engine.init_distributed("gloo")
    path = embedded.resolve_model("cleanrlhf/tiny")
    tokenizer = models.load_tokenizer(path)
    episodes = rollout(len(tokenizer))
    run = SimpleNamespace(rank=rank, world=world, device=device)
    results = {}
    for name, module in (("grpo", grpo), ("reinforce_pp", reinforce_pp), ("ppo", ppo)):
        args = module.Args()
        args.train.minibatches, args.train.epochs, args.train.micro_batch_size, args.train.sp_size = 2, 2, 3, world
        args.algo.entropy_coef, args.algo.kl_coef = 0.01, 0.1
        args.actor.model = ModelConfig(name_or_path=path, dtype="fp32", attn_implementation="sdpa")
        args.ds = DSConfig(zero_stage=3)
        torch.manual_seed(0)
        actor = rl.make_actor(args, device, args.actor.lr)  # the SP setup happens here
        ref = ds_engine.make_frozen(models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")),
                                    RefConfig(zero_stage=3), device)  # fmt: skip
        seqs = rl.sequences(episodes, tokenizer.pad_token_id, device)
        if module is grpo:
            metrics = grpo.update(actor, ref, seqs, torch.linspace(-1.0, 1.0, len(episodes)), args, run, 0, 0.1)
        elif module is ppo:
            args.critic.warmup_steps = 0  # the actor trains at step 0 too
            critic = ppo.make_critic(args, 10, device=device)  # its SP setup happens here
            rewards = torch.linspace(0.0, 1.0, len(episodes))
            metrics = ppo.update(actor, critic, ref, seqs, rewards, args, run, 0, 0.1)
        else:
            metrics = reinforce_pp.update(actor, ref, seqs, torch.linspace(0.0, 1.0, len(episodes)), args, run, 0, 0.1)
        results[name] = metrics
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # every rank past its last collective before any rank tears the world down: both ranks of a finished run once
    # died with SIGABRT at exit ("terminate called without an active exception") while the other still had gloo work
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
