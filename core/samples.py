"""What the model wrote: a few samples of every step in `<run>/samples.jsonl`, with what the loss saw per token.

Every RL script keeps `--logger.samples N` samples of each step's rollout (whole prompt groups, the kept ones
first): prompt and response text, reward and the reward function's per-sample extra fields, advantage, kept or
filtered, truncated, length, the minibatch it was trained in, and per response token its text, the engine's log-prob
and, for a trained sample, the trainer's log-prob before this step's first update (`old_logp`) and when the loss took
it (`trainer_logp`), and what the loss itself computed and used: the ratio π_θ/π_old, the advantage, the entropy and
the KL to the reference, as the script's `policy_loss` returned them (nothing is recomputed here), from the first pass
of the update over the sample. Every eval adds `--logger.eval-samples` greedy answers
with whether they were right. The rows go to samples.jsonl (`RunLogger.log_samples`, which also sends them to
TensorBoard and W&B), and every `--logger.show-every` steps one sample is shown in a panel on the console.

The scripts call three things, in this order:
    trace = samples.Trace(samples.watch(keep, G, args.logger.samples), kept)   # before the update
    loss, metrics, used = policy_loss(...)                                      # in the update, per micro-batch:
    trace.add(r, mb["loss_mask"], minibatch=k, logp=logp, old_logp=old, **used)  # what the loss used
    samples.log(run, args, step, ro, rewards, keep, trace, adv)                # after it, on every rank

One row of samples.jsonl (`kind` "train"; eval rows carry `correct`/`label` and no trainer quantities):
    {"step", "kind", "index", "group", "prompt", "response", "reward", "extra", "advantage", "kept", "truncated",
     "length", "minibatch", "tokens": {"text", "engine_logp", "trained", "old_logp", "trainer_logp", "ratio",
     "advantage", "entropy", "kl", "value"}}
with one entry per response token in every token list (null where a quantity was not computed: an environment's
token, a filtered sample). `core.report` reads it.
"""

from __future__ import annotations

import math

import torch

TOKEN_KEYS = ("old_logp", "trainer_logp", "ratio", "advantage", "entropy", "kl", "value")
"""Per-token quantities of the update a row may hold, beside the engine's log-prob and the token text."""


def watch(keep: torch.Tensor, group_size: int, n: int) -> list[int]:
    """Which samples of a step's rollout to keep: whole groups of `group_size` (so a group's advantages can be read
    together), the groups the update trains on first, in rollout order, until `n` samples. keep: (B,) bool."""
    if n <= 0:
        return []
    groups = range(len(keep) // group_size)
    order = [g for g in groups if keep[g * group_size]] + [g for g in groups if not keep[g * group_size]]
    return [g * group_size + j for g in order for j in range(group_size)][:n]


class Trace:
    """The update's per-token quantities for the watched samples, recorded the first time each passes through a
    micro-batch: what the loss used for it in the update's first pass, as the script's loss returned it, and the
    minibatch it was in. The engine's log-prob against `old_logp` (the trainer's, before this step's first update) is
    the engine/trainer mismatch; `ratio` is the policy's own move since then (1 in the first minibatch)."""

    def __init__(self, watched: list[int], rows: list[int]):
        """watched: rollout indices (`watch`); rows: the rollout index of each row of the update's table (the kept
        samples)."""
        row_of = {i: n for n, i in enumerate(rows)}
        self.watched = list(watched)
        self.index_of_row = {row_of[i]: i for i in watched if i in row_of}
        self.tokens: dict[int, dict[str, list]] = {}  # rollout index -> {quantity: values over the whole row}
        self.minibatch: dict[int, int] = {}  # rollout index -> the minibatch (of the first epoch) it trained in

    @torch.no_grad()
    def add(self, r: list[int], mask: torch.Tensor, *, minibatch: int | None = None,
            **tokens: torch.Tensor | None) -> None:  # fmt: skip
        """One micro-batch of rows `r` (indices into the update's table) of minibatch `minibatch`: `tokens` are (b, L)
        tensors in its layout, stored as given (None: not computed), e.g. `logp=` (stored as `trainer_logp`),
        `old_logp=` and what the script's `policy_loss` returned (`ratio`, `advantage`, `entropy`, `kl`) or its
        critic's `value`."""
        if not any(row in self.index_of_row for row in r):
            return
        if "logp" in tokens:
            tokens["trainer_logp"] = tokens.pop("logp")
        for j, row in enumerate(r):
            i = self.index_of_row.get(row)
            if i is None or i in self.tokens:
                continue
            on = mask[j].bool()
            self.tokens[i] = {k: torch.where(on, v[j].float(), float("nan")).tolist() for k, v in tokens.items()
                              if v is not None}  # fmt: skip
            if minibatch is not None:
                self.minibatch[i] = minibatch

    def gather(self, world: int) -> dict[int, dict[str, list]]:
        """Every rank's recorded rows (each rank saw its own micro-batches): one all-gather."""
        if world == 1:
            return self.tokens
        parts = [None] * world
        torch.distributed.all_gather_object(parts, (self.tokens, self.minibatch))
        self.minibatch = {i: k for _, part in parts for i, k in part.items()}
        return {i: t for part, _ in parts for i, t in part.items()}


NO_TRACE = Trace([], [])
"""A trace that records nothing: the default of the scripts' `update(..., trace=)` (a direct call, e.g. in a test)."""


def _num(x: float) -> float | None:
    """A JSON-safe number: NaN/inf (a position the loss did not see) become null; 6 significant digits."""
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included, so an eos shows)."""
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def episode_row(tokenizer, episode, step: int, kind: str, index: int, reward: float) -> dict:
    """The part of a samples.jsonl row every kind of sample has: texts, reward, extra fields, length, the tokens
    with the engine's log-probs."""
    return {"step": step, "kind": kind, "index": index, "prompt": str(episode.example.get("prompt", "")),
            "response": tokenizer.decode(episode.token_ids, skip_special_tokens=False), "reward": _num(reward),
            "extra": {k: _num(float(v)) for k, v in getattr(episode, "extra", {}).items()},
            "truncated": bool(episode.truncated), "length": len(episode.token_ids),
            "tokens": {"text": _token_texts(tokenizer, episode.token_ids),
                       "engine_logp": [_num(x) for x in episode.logprobs], "trained": list(episode.action_mask)}}  # fmt: skip


def train_rows(tokenizer, ro, step: int, group_size: int, rewards: torch.Tensor, keep: torch.Tensor,
               trace: Trace, traced: dict, adv: torch.Tensor | None = None) -> list[dict]:  # fmt: skip
    """samples.jsonl rows of step `step`'s watched samples. adv: (B,) a per-sample advantage when the script has
    one (GRPO's, RLOO's); else the mean of the traced per-token advantages."""
    rows = []
    for i in sorted(trace.watched):
        ep = ro.episodes[i]
        row = episode_row(tokenizer, ep, step, "train", i, rewards[i].item())
        start = len(ep.prompt_ids)  # the table's row: prompt + response; response token k sits at start + k
        tokens = {k: [_num(x) for x in v[start : start + len(ep.token_ids)]] for k, v in traced.get(i, {}).items()}
        row["tokens"].update(tokens)
        if adv is not None:
            advantage = _num(adv[i].item())
        else:  # a per-token advantage (PPO's GAE, distillation's log-ratio): its mean over the trained tokens
            seen = [x for x in tokens.get("advantage", []) if x is not None]
            advantage = _num(sum(seen) / len(seen)) if seen else None
        rows.append(row | {"group": i // group_size, "advantage": advantage, "kept": bool(keep[i]),
                           "minibatch": trace.minibatch.get(i)})  # fmt: skip
    return rows


def panel(row: dict):
    """A rich panel of one sample for the console: prompt, response, reward (markup in the texts is not read)."""
    from rich.panel import Panel
    from rich.text import Text

    body = Text()
    body.append("prompt   ", style="bold cyan").append(row["prompt"][-400:] + "\n")
    body.append("response ", style="bold green").append(row["response"][:800] + "\n")
    extra = "  ".join(f"{k}={v:.3g}" for k, v in row["extra"].items() if v is not None)
    adv = row.get("advantage")
    body.append(f"reward {row['reward']}" + (f"   advantage {adv:.3g}" if adv is not None else "")
                + ("   truncated" if row["truncated"] else "") + (f"   {extra}" if extra else ""), style="bold")  # fmt: skip
    return Panel(body, title=f"step {row['step']}: sample {row['index']} (group {row.get('group')})", expand=False)


def log(run, step: int, ro, rewards: torch.Tensor, keep: torch.Tensor, trace: Trace, group_size: int,
        adv: torch.Tensor | None = None) -> None:  # fmt: skip
    """After step `step`'s update, on every rank (the trace is gathered from all): rank 0 writes the watched
    samples (prompts of `group_size` samples each) to samples.jsonl under the step's metrics row (`step + 1`) and,
    every `--logger.show-every` steps (the run logger's section), shows one of them (the first trained one) on the
    console."""
    if not trace.watched:
        return
    traced = trace.gather(run.world)
    if run.rank != 0:
        return
    rows = train_rows(run.executor.tokenizer, ro, step + 1, group_size, rewards, keep, trace, traced, adv)
    run.logger.log_samples(rows, step + 1)
    every = run.logger.cfg.show_every
    if every and (step + 1) % every == 0 and rows:
        run.logger.print(panel(rows[0]))


def eval_rows(tokenizer, greedy, step: int, n: int) -> list[dict]:
    """The first `n` greedy answers of an eval at `step` (its rollout `greedy`), with whether each was right (reward
    above 0.5, as pass@1 counts it) and the label."""
    rows = []
    for i, ep in enumerate(greedy.episodes[:n]):
        reward = greedy.rewards[i].item()
        row = episode_row(tokenizer, ep, step, "eval", i, reward)
        row["tokens"]["trained"] = [0] * len(ep.token_ids)  # an eval answer: no loss sees it
        rows.append(row | {"correct": reward > 0.5, "label": str(ep.example.get("label", ""))})
    return rows


def _pair_side(tokenizer, side) -> tuple[str, str]:
    """(prompt, response) text of one side of a preference pair: a DPO/KTO example (`input_ids` with a `loss_mask`
    on the response) or a reward model's token ids (the whole text, no prompt split)."""
    if isinstance(side, dict):
        ids, mask = side["input_ids"], side["loss_mask"]
        prompt = [t for t, m in zip(ids, mask) if not m]
        response = [t for t, m in zip(ids, mask) if m]
        return tokenizer.decode(prompt, skip_special_tokens=False), tokenizer.decode(response, skip_special_tokens=False)
    return "", tokenizer.decode(list(side), skip_special_tokens=False)


def pair_rows(tokenizer, pairs: list[dict], chosen: torch.Tensor, rejected: torch.Tensor, step: int,
              n: int) -> list[dict]:  # fmt: skip
    """samples.jsonl rows (kind "pair") of the first `n` held-out preference pairs of an eval at `step`, with the
    scores the script ranks them by (DPO's implicit rewards, a reward model's scores) and their margin."""
    rows = []
    for i, pair in enumerate(pairs[:n]):
        prompt, good = _pair_side(tokenizer, pair["chosen"])
        _, bad = _pair_side(tokenizer, pair["rejected"])
        c, r = float(chosen[i]), float(rejected[i])
        rows.append({"step": step, "kind": "pair", "index": i, "prompt": prompt, "chosen": good, "rejected": bad,
                     "chosen_score": _num(c), "rejected_score": _num(r), "margin": _num(c - r)})  # fmt: skip
    return rows
