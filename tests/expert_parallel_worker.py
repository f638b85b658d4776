"""DeepSpeed AutoEP through `core.engine.make_engine`, under `torchrun --nproc_per_node 2` (gloo and fp32 unless argv[2]
and argv[3] name a backend and a dtype: `auto bf16` on 2 GPUs, tests/test_gpu.py): the embedded
`cleanrlhf/tiny-moe` trained 3 steps at ZeRO 0, 2 and 3 with `--ds.expert-parallel-size 2` (each rank holds 2 of each
layer's 4 experts) and without (every rank holds all 4), on the same data split (each rank its half of every batch).
Rank 0 writes {case: numbers} as JSON to argv[1]: per step the loss and the gradient norm as each rank sees it, the
whole weights' names and shapes (`core.weights.gathered_state_dict`, what the HF export saves; the names the weight
sync sends, `full_named_parameters`), the largest gap of the weights from the EP=1 engine's, relative to how far
EP=1 moved them, and why `zero3_partitions` does not send the partitions as they are."""

import json
import sys

import torch
import torch.distributed as dist

from core import embedded, models, weights
from core import engine as ds_engine
from core.config import DSConfig, ModelConfig

STEPS = 3


def train(ep: int, stage: int, dtype: str, device: torch.device) -> tuple[dict, dict | None, list[str]]:
    torch.manual_seed(0)
    path = embedded.resolve_model("cleanrlhf/tiny-moe")
    model = models.load_causal_lm(ModelConfig(name_or_path=path, dtype=dtype)).to(device)
    engine = ds_engine.make_engine(model, DSConfig(expert_parallel_size=ep, zero_stage=stage), 1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    log: dict = {"loss": [], "norms": []}
    for step in range(STEPS):
        ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(step))
        mine = ids.chunk(world)[rank].to(device)
        loss = engine(input_ids=mine, labels=mine, use_cache=False).loss  # + the router's aux loss, its own coef
        engine.backward(loss)
        norm = torch.tensor(ds_engine.optimizer_step(engine, step), device=device)
        norms = [torch.zeros((), device=device) for _ in range(world)]
        dist.all_gather(norms, norm)  # every rank's own view of the step's gradient norm
        log["loss"].append(ds_engine.all_reduce(loss.item()) / world)
        log["norms"].append([n.item() for n in norms])
    names = [n for n, _ in weights.full_named_parameters(engine)]  # collective
    log["sync_names"] = names
    log["zero3_partitions"] = weights.zero3_partitions(engine)[1]
    return log, weights.gathered_state_dict(engine), names


def main(out: str, backend: str = "gloo", dtype: str = "fp32") -> None:
    _, _, device = ds_engine.init_distributed(backend)
    base = {k: v.clone() for k, v in models.load_causal_lm(ModelConfig(name_or_path=embedded.resolve_model(
        "cleanrlhf/tiny-moe"))).state_dict().items()}  # fmt: skip
    results = {}
    for stage in (0, 2, 3):
        one, state1, _ = train(1, stage, dtype, device)
        ep, state2, _ = train(2, stage, dtype, device)
        if dist.get_rank() == 0:
            state1, state2 = ({k: v.float() for k, v in s.items()} for s in (state1, state2))
            gaps = {k: ((state2[k] - state1[k]).norm() / (state1[k] - base[k]).norm()).item() for k in state2}
            ep["state"] = {k: list(v.shape) for k, v in state2.items()}
            ep["moved"] = min((state2[k] - base[k]).norm().item() for k in state2)
            ep["gap"], ep["gap_at"] = max(gaps.values()), max(gaps, key=gaps.get)
            results[f"zero{stage}"] = {"ep1": one, "ep2": ep}
    if dist.get_rank() == 0:
        results["base"] = {k: list(v.shape) for k, v in base.items()}
        json.dump(results, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
