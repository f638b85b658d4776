"""Mixture-of-experts routing: record which experts a forward chose, replay a recorded choice, and measure how often
two forwards chose differently. The mechanism under rollout routing replay (R3, Ma et al. 2025, arXiv:2510.11370):
the engine that sampled a response records each token's experts per MoE layer, and the trainer's forward of that
response uses them, so the importance ratio measures the policy's change and not routing noise.

A routing table is a (tokens, layers, top_k) int64 tensor in the forward's own flattened token order (row b·T + t of
a (B, T) input; a packed forward's rows likewise), one column per MoE layer in model order (an engine's per-sample
tables are int16, `SAMPLE_DTYPE`, to travel light; `table_for_forward` widens them). `record_routing` fills
one from a forward; `replay_routing` makes a forward use one: the router still computes its logits, the selection is
the recorded one, and the routing weights are the live router's probabilities of the recorded experts
(softmax over all experts, gathered; renormalised where the model's `norm_topk_prob` says), so the gradient still
reaches the router. `routing_mismatch` is the share of (token, layer) decisions whose expert sets differ.

Supported: the top-k routers of Qwen2-MoE and Qwen3-MoE as transformers 5.19 builds them (`Qwen2MoeTopKRouter`,
`Qwen3MoeTopKRouter`: `forward(hidden) -> (logits, weights, indices)`). `check_routing_replay` refuses a dense model
or another architecture, naming the flag. The router's load-balancing loss recomputes its own top-k from the logits:
it does not see a replayed selection (the scripts log it, they do not train on it).

`table_for_forward` lays per-sequence tables out for one forward of a packed (or padded) batch.

The engines' side: the transformers engine (`--vllm.engine hf`) records each sample's table from its own `generate`
(`record_generate`, `generated_table`). vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only through
its Model Runner V2, which needs Triton, absent from its CPU build (refused at engine start on CPU); the vLLM engine
(`--vllm.engine vllm`) records instead through a hook on its model's routers, step by step
(`core.vllm_engine.WorkerExtension.cleanrlhf_record_routing`), and `EngineRecord` puts the steps back together per
sequence, prefix-cache hits included, in the same layout. A sequence sampled by several generations (a multi-turn
episode's turns, an agent's chain of calls, a partial rollout's segments) gets one table from theirs
(`joined_tables`: each position keeps the routing of the first generation that forwarded it, which for a position
before a sampled token is the generation that sampled it). `check_replay_flags` refuses what is not carried yet.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

SAMPLE_DTYPE = torch.int16
"""the dtype of the tables engines hand out per sample (`Sample.routed_experts`): expert ids below 2**15, a quarter of
int64's bytes (48 MoE layers × top-8 are 768 bytes a token, carried from the engine to every trainer rank);
`table_for_forward` widens them for the forward."""

ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
"""the router classes whose `forward(hidden) -> (logits, weights, indices)` this module records and replays."""


def routers(model) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model). `model`: an HF model, or anything whose
    `.module` is one (a DeepSpeed engine)."""
    hf = getattr(model, "module", model)
    return [m for m in hf.modules() if type(m).__name__ in ROUTERS]


def check_routing_replay(model, flag: str) -> None:
    """Refuse routing replay for a model without supported routers: a dense model, or an MoE whose router is not one
    of `ROUTERS` (named by its class)."""
    if routers(model):
        return
    hf = getattr(model, "module", model)
    arch = type(hf).__name__
    if getattr(getattr(hf, "config", None), "router_aux_loss_coef", None) is None:
        raise ValueError(f"{flag}: {arch} is a dense model: it has no experts to replay")
    raise ValueError(f"{flag}: {arch}'s router is not supported (supported: {', '.join(ROUTERS)})")


MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
"""the `config.model_type`s whose routers are `ROUTERS`."""


def check_config(config, flag: str) -> None:
    """`check_routing_replay` on a model's config, before the model is loaded: a dense model or another MoE
    architecture is refused naming `flag`."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", "?")
    if kind in MODEL_TYPES:
        return
    if getattr(config, "router_aux_loss_coef", None) is None and not getattr(config, "num_experts", None):
        raise ValueError(f"{flag}: {kind} is a dense model: it has no experts to replay")
    raise ValueError(f"{flag}: {kind}'s router is not supported (supported model types: {', '.join(MODEL_TYPES)})")


def check_replay_flags(args) -> None:
    """Refuse, before anything loads, what `--actor.routing-replay` does not carry yet, naming both flags: gradient
    checkpointing, sequence parallelism (the table does not follow the split), and a dense or unsupported actor
    (`check_config`). Episodes sampled by several generations are carried, `joined_tables` joining their tables:
    multi-turn (`--rollout.env-file`, agents/executor.py), agent episodes (`--rollout.agent-file`,
    agents/records.py's `trajectory_routing`) and partial rollout (`core.rollout.joined_routing`)."""
    flag = "--actor.routing-replay"
    train = args.train
    if args.actor.model.gradient_checkpointing:  # the backward's recomputed forward runs outside the replay
        raise ValueError(f"{flag} with --actor.model.gradient-checkpointing: the backward recomputes the forward "
                         "after the replay hooks are gone, and would route it afresh")  # fmt: skip
    if train.sp_size > 1:
        raise ValueError(f"{flag} with --train.sp-size {train.sp_size}: the routing table does not follow the "
                         "sequence-parallel split of the tokens")  # fmt: skip


@contextmanager
def record_routing(model):
    """`with record_routing(model) as table:` after the forward(s) inside, `table["experts"]` is the (tokens, layers,
    top_k) int64 selection of the last forward (each router's top-k indices, as it computed them)."""
    mods, seen = routers(model), {}
    table: dict = {}

    def keep(i):
        def hook(module, args, output):
            seen[i] = output[2].detach().to(torch.long).cpu()

        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(mods)]
    try:
        yield table
    finally:
        for h in handles:
            h.remove()
        if len(seen) == len(mods) and mods:
            table["experts"] = torch.stack([seen[i] for i in range(len(mods))], dim=1)


def replayed_weights(logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The routing weights of `experts` (T, k) under the live router `logits` (T, E): softmax over all E experts in
    float32, gathered at the given experts, renormalised over them when `norm_topk_prob`; in the logits' dtype. The
    router's own weights for its own top-k, so a replay of what it chose changes nothing."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, experts)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


@contextmanager
def record_generate(model):
    """`with record_generate(model) as calls:` every router call of a `generate` inside (the prefill over the whole
    (B, width) prompt table, then one token per row per step) appended to `calls` as the (B, s, layers, top_k)
    selection of its s new positions. `generated_table` cuts one sample's table out of them."""
    mods, calls = routers(model), []
    pending: dict = {}

    def keep(i):
        def hook(module, args, output):
            pending[i] = output[2].detach().to(torch.long).cpu()
            if len(pending) == len(mods):  # the last MoE layer of this forward
                calls.append(torch.stack([pending[j] for j in range(len(mods))], dim=1))
                pending.clear()

        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(mods)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def generated_table(calls: list[torch.Tensor], rows: int, row: int, width: int, prompt_len: int, response_len: int):
    """Row `row`'s routing table (prompt_len + response_len − 1, layers, top_k; `SAMPLE_DTYPE`) in token order, from `record_generate`'s
    `calls` of a `generate` over `rows` left-padded rows of `width` tokens: the prompt (its padding dropped), then every
    response token but the last, which the engine sampled and never forwarded (`table_for_forward` routes that
    position to filler experts: its output predicts past the response and is never read)."""
    per_row = torch.cat([c.view(rows, -1, *c.shape[1:]) for c in calls], dim=1)  # (rows, width + steps, layers, k)
    return per_row[row, width - prompt_len : width + response_len - 1].to(SAMPLE_DTYPE)


@contextmanager
def replay_routing(model, experts: torch.Tensor, own: list | None = None):
    """Forwards inside use `experts` (tokens, layers, top_k), a table of `record_routing`'s shape in the forward's
    flattened token order, instead of each router's own top-k; the weights are `replayed_weights` of the live logits.
    A table whose shape does not fit the forward is refused by the router's hook (naming both shapes). `own`: a list
    that receives, per forward, the (tokens, layers, top_k) selection the routers made themselves before the replay
    replaced it (what `routing_mismatch` compares with the table, without a second forward)."""
    mods = routers(model)
    if experts.dim() != 3 or experts.shape[1] != len(mods):
        raise ValueError(f"routing replay: a table of shape {tuple(experts.shape)} for {len(mods)} MoE layers "
                         "(expected (tokens, layers, top_k))")  # fmt: skip
    seen: dict = {}

    def force(i):
        def hook(module, args, output):
            logits = output[0]
            chosen = experts[:, i].to(device=logits.device, dtype=torch.long)
            if chosen.shape != output[2].shape:
                raise ValueError(f"routing replay: layer {i} routes {tuple(output[2].shape)} (tokens, top_k), the "
                                 f"table holds {tuple(chosen.shape)}")  # fmt: skip
            if own is not None:
                seen[i] = output[2].detach().to(torch.long).cpu()
                if len(seen) == len(mods):
                    own.append(torch.stack([seen[j] for j in range(len(mods))], dim=1))
                    seen.clear()
            return logits, replayed_weights(logits, chosen, bool(getattr(module, "norm_topk_prob", False))), chosen

        return hook

    handles = [m.register_forward_hook(force(i)) for i, m in enumerate(mods)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def table_for_forward(rows: list[torch.Tensor], index: torch.Tensor, numel: int) -> torch.Tensor:
    """The routing table of one forward over a batch laid out by `index` (b, L): row b's recorded table rows[b]
    (n_b, layers, top_k) in token order, token (b, t) at flat position index[b, t] of the forward's (R, W) input
    (`core.rl.model_inputs`' index: packed rows, or the padded table itself), −1 where (b, t) is padding. Positions
    no token fills (a packed row's pad tail, a padded table's padding) route to experts 0..top_k−1: their outputs are
    never read; so does a sequence's last token when its table is one row short (an engine's record: the last sampled
    token was never forwarded, and its output, predicting past the response, is never read), and a row with no table
    (None: an episode with no trained token, e.g. a failed agent episode). -> (numel, layers, top_k) for a forward of
    `numel` = R·W tokens."""
    layers, k = next(t for t in rows if t is not None).shape[1:]
    out = torch.arange(k).expand(numel, layers, k).clone()
    for b, table in enumerate(rows):
        if table is None:
            continue
        where = index[b][index[b] >= 0].cpu()
        if len(table) == len(where) - 1:  # an engine's record: the last token was not forwarded
            where = where[:-1]
        if len(where) != len(table):
            raise ValueError(f"routing replay: row {b} has {len(where)} tokens in the batch and {len(table)} recorded")
        out[where] = table.to(out.dtype)
    return out


def joined_tables(tables: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """The routing table of one sequence sampled by several generations, each over a context that extends the one
    before (a multi-turn episode's turns, the calls of an agent's chain, a partial rollout's segments): `tables[j]`
    generation j's own record (its prompt and sampled tokens but the last), `lengths[j]` its rows up to its last kept
    token (its prompt + kept tokens − 1; ≤ its table). Each position takes the row of the first generation that
    reaches it: generation j's rows from where generation j − 1's stop to `lengths[j]`. So the position before a
    sampled token, whose output the loss reads for that token, keeps the routing of the forward that sampled it, and
    the positions whose outputs predict the tokens between two generations (environment or template tokens, not
    trained) keep that of their first forward, the next generation's: the context its sampled tokens were drawn
    over. One row per position cannot hold every generation's routing of a shared prefix (a later generation routes
    it again, alike only up to float rounding with the same weights). None if any generation carries no table."""
    if any(t is None for t in tables):
        return None
    out = tables[0][: lengths[0]]
    for table, n in zip(tables[1:], lengths[1:]):
        assert len(out) <= n <= len(table), f"a generation of {len(table)} rows to keep up to {n}, after {len(out)}"
        out = torch.cat([out, table[len(out) : n]])
    return out


def recorded_positions(rows: list[torch.Tensor], index: torch.Tensor, numel: int) -> torch.Tensor:
    """(numel,) bool: the positions of `table_for_forward`'s forward that a recorded row fills (not padding, not the
    unrecorded last token of an engine's record): where `routing_mismatch` compares."""
    valid = torch.zeros(numel, dtype=torch.bool)
    for b, table in enumerate(rows):
        if table is None:
            continue
        valid[index[b][index[b] >= 0].cpu()[: len(table)]] = True
    return valid


def routing_mismatch(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """The share of (token, layer) decisions where two routing tables (tokens, layers, top_k) chose different expert
    sets (the order within a top-k does not count); `valid` (tokens,) bool keeps only those tokens."""
    if a.shape != b.shape:
        raise ValueError(f"routing tables of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    differ = (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)  # (tokens, layers)
    if valid is not None:
        differ = differ[valid]
    return float(differ.float().mean()) if differ.numel() else 0.0


class EngineRecord:
    """The routing of every request a vLLM engine forwarded, put back together per sequence from its engine steps
    (`core.vllm_engine.WorkerExtension.cleanrlhf_record_routing` records them).

    A step is a dict: `req_ids` (the requests in the step's batch order), `counts` (tokens each computes in the step),
    `positions` and `tokens` (N,) of the step's flattened rows, `experts` (N, layers, top_k) the routers' top-k of those
    rows, `prompts` {request id: prompt token ids} of the requests the step starts. Rows land by position, so a
    request's prefill (whole or in chunks), its one-token decode steps and a recompute after preemption (a later row
    of the same position replaces the earlier) all fill one table.

    Prefix caching: a request whose prompt starts with `block`-token blocks already in the engine's KV cache computes
    only the rest; the cached positions were routed by whichever request computed them, in this call or an earlier one.
    Every finished table is kept here by its token prefix at each multiple of `block` (`prefixes`), and a request that
    starts at position c takes rows 0..c−1 from the prefix of its own first c tokens. The engine's cache and this one
    must be emptied together (`clear`, at every `reset_prefix_cache`)."""

    def __init__(self, block: int):
        self.block = block
        self.prefixes: dict[tuple[int, ...], torch.Tensor] = {}
        self.rows: dict[str, list] = {}  # request id -> [(positions, tokens, experts)] from each step
        self.prompts: dict[str, list[int]] = {}
        self.cached_rows = 0
        """rows taken from `prefixes` so far (prompt tokens that requests found in the engine's prefix cache)."""

    def add(self, steps: list[dict]) -> None:
        for step in steps:
            self.prompts.update(step["prompts"])
            start = 0
            for rid, count in zip(step["req_ids"], step["counts"]):
                end = start + count
                part = (step["positions"][start:end], step["tokens"][start:end], step["experts"][start:end])
                self.rows.setdefault(rid, []).append(part)
                start = end

    def finish(self) -> dict[tuple[int, ...], torch.Tensor]:
        """Every request recorded since the last `finish`, as {its forwarded tokens: its (tokens, layers, top_k)
        `SAMPLE_DTYPE` table}; the forwarded tokens are the prompt and every sampled token but the last (never forwarded).
        Two requests with the same tokens share a key (their tables are the same routing up to batch-order rounding).
        Raises if a request's cached prefix was not recorded here."""
        out: dict[tuple[int, ...], torch.Tensor] = {}
        firsts = {rid: min(int(p.min()) for p, _, _ in parts if len(p)) for rid, parts in self.rows.items()}
        for rid in sorted(self.rows, key=firsts.__getitem__):  # a cached prefix's source before its users
            parts, first = self.rows.pop(rid), firsts[rid]
            prompt = self.prompts.pop(rid)
            positions = torch.cat([p for p, _, _ in parts]).long()
            length = int(positions.max()) + 1
            tokens = torch.full((length,), -1, dtype=torch.long)
            tokens[: min(len(prompt), length)] = torch.tensor(prompt[:length], dtype=torch.long)
            experts = torch.cat([e for _, _, e in parts]).to(SAMPLE_DTYPE)
            table = torch.empty((length, *experts.shape[1:]), dtype=SAMPLE_DTYPE)
            table[positions] = experts  # in step order: a recomputed position keeps its last routing
            tokens[positions] = torch.cat([t for _, t, _ in parts]).long()
            seq = tuple(tokens.tolist())
            if first > 0:
                cached = self.prefixes.get(seq[:first])
                if cached is None:
                    raise RuntimeError(f"routing record: request {rid} took {first} prompt tokens from the prefix "
                                       "cache, computed by no request recorded since the last reset_prefix_cache")  # fmt: skip
                table[:first] = cached
                self.cached_rows += first
            seen = torch.zeros(length, dtype=torch.bool)
            seen[:first], seen[positions] = True, True
            assert bool(seen.all()), f"routing record: request {rid} has positions no step computed"
            for m in range(self.block, length + 1, self.block):
                self.prefixes[seq[:m]] = table[:m]
            out[seq] = table
        self.prompts.clear()
        return out

    def clear(self) -> None:
        """Forget the cached prefixes (the engine's prefix cache was reset: new weights)."""
        self.prefixes.clear()
