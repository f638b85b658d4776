"""One GRPO and one PPO update (actor, critic, reference) on a fixed rollout with mixed response lengths, under
`torchrun --nproc_per_node N`, in three layouts: right-padded micro-batches of rows, packed micro-batches of rows,
packed micro-batches filled to a token budget. Models are DeepSpeed ZeRO-3 engines (fp32, gloo) built from the same
seed for every layout. Rank 0 writes {layout: metrics} as JSON to argv[1]; tests/test_rl_packing.py compares them.
"""

import json
import random
import sys
from types import SimpleNamespace

import torch

from agents.executor import Episode
from algos import grpo, ppo
from core import embedded, models, rl
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig, RefConfig

LAYOUTS = {"padded": (False, None), "packed": (True, None), "packed_tokens": (True, 96)}


def rollout(vocab: int, n: int = 12) -> list[Episode]:
    """n episodes, prompts of 3-9 tokens, responses of 1-60 (a mix of short and long, as a real rollout has)."""
    rng = random.Random(0)
    episodes = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 4, 12, 30, 60]))]
        episodes.append(Episode({}, prompt, response, [-2.0] * len(response), [1] * len(response), False))
    return episodes


def engines(path: str, seed: int = 0):
    ds = DSConfig(zero_stage=3)
    torch.manual_seed(seed)
    actor = ds_engine.make_engine(models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")), ds, lr=1e-3)
    critic = ds_engine.make_engine(models.TokenValues(models.load_scalar_model(path, "fp32")), ds, lr=1e-3)
    ref = ds_engine.make_frozen(models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")),
                                RefConfig(zero_stage=3), torch.device("cpu"))  # fmt: skip
    return actor, critic, ref


def main(out: str) -> None:
    rank, world, device = ds_engine.init_distributed("gloo")
    path = embedded.resolve_model("cleanrlhf/tiny")
    tokenizer = models.load_tokenizer(path)
    episodes = rollout(len(tokenizer))
    run = SimpleNamespace(rank=rank, world=world, device=device)
    results = {}
    for name, (packed, budget) in LAYOUTS.items():
        seqs = rl.sequences(episodes, tokenizer.pad_token_id, device, packed)
        g = grpo.Args()
        g.train.minibatches, g.train.epochs, g.train.micro_batch_size, g.train.max_tokens_per_micro = 2, 2, 2, budget
        g.algo.entropy_coef, g.algo.kl_coef = 0.01, 0.1
        adv = torch.linspace(-1.0, 1.0, len(episodes))
        actor, critic, ref = engines(path)
        out_g = grpo.update(actor, ref, seqs, adv, g, run, step=0, kl_coef=0.1)
        p = ppo.Args()
        p.train.minibatches, p.train.micro_batch_size, p.train.max_tokens_per_micro = 2, 2, budget
        p.critic.warmup_steps, p.algo.kl_coef = 0, 0.05
        rewards = torch.linspace(0.0, 1.0, len(episodes))
        out_p = ppo.update(actor, critic, ref, seqs, rewards, p, run, step=0, kl_coef=0.05)
        results[name] = {**{f"grpo/{k}": v for k, v in out_g.items()}, **{f"ppo/{k}": v for k, v in out_p.items()}}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # every rank past its last collective before any rank tears the world down: both ranks of a finished run once
    # died with SIGABRT at exit ("terminate called without an active exception") while the other still had gloo work
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
