"""What the agent server (agents/openai_server.py) records, and the trajectory it gives the trainer: per episode its
calls as token ids (`EpisodeLog`, `Call`), per request in flight its choices' futures (`Job`), and the trained chain of
an episode's calls (`build_trajectory`: calls -> prompt, tokens, log-probs, action mask)."""

import asyncio
from dataclasses import dataclass, field

import torch

from agents.request_checks import Params
from core import moe


@dataclass
class Call:
    """One recorded generation (one choice of a request) of an episode. `prompt_ids` are exactly the ids the engine
    was given, `token_ids` and `logprobs` (same length) exactly what it returned, cut after a stop string."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (eos or end-of-turn token, the last of `token_ids`; or a stop string) or `length` (the token limit)."""
    parent: int | None
    """index of the call of the same episode this one continues; None: it starts a new chain."""
    prompt_text: str | None = None
    """the prompt as text (rendered messages or the completions prompt); None for a prompt given as token ids."""
    text: str = ""
    """the returned text: `token_ids` decoded without special tokens, ending before a stop string."""
    stop_text: str | None = None
    """the generated text after `text`: a special stop token (eos, `<|im_end|>`) or a stop string and whatever its
    last token carried after it; None when `text` is all of it."""
    text_tokens: int | None = None
    """how many of `token_ids` a later prompt keeps when it carries `text` but not `stop_text`: the tokens whose text
    lies within `text` (a stop string cut); None: all but the last (a special stop token)."""
    request: int = 0
    """the episode's sample number of the request's first choice (its seed is episode seed + 7919 · this + choice)."""
    choice: int = 0
    """which of the request's `n` choices this is."""
    content: str | None = ""
    """`message.content` as answered: `text`, or the text before the first tool call (None when there is none)."""
    tool_calls: list[dict] = field(default_factory=list)
    """`message.tool_calls` as answered (OpenAI's shape: id, type "function", function {name, arguments})."""
    tool_parse_error: str | None = None
    """why the tool-call markup of `text` did not parse (it was answered as plain content); None: it did, or none."""
    top_logprobs: list[dict[int, float]] | None = None
    """per token of `token_ids`, the engine's k most likely tokens {id: log-prob}; None unless the request asked."""
    routed_experts: torch.Tensor | None = None
    """`--actor.routing-replay`: the sample's routing table (`Sample.routed_experts`: `prompt_ids` and every token
    the engine sampled but the last, before any cut at a stop string); None otherwise."""


@dataclass
class EpisodeLog:
    """What the server records for one episode: its sampling settings and its calls, in the order they finished."""

    temperature: float
    seed: int | None
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    """samples sent to the engine so far (numbers the samples' seeds)."""
    bad_requests: int = 0
    """requests of this episode answered with HTTP 4xx."""
    tool_calls: int = 0
    """tool calls parsed from the model's answers."""
    tool_parse_errors: int = 0
    """answers to a request with tools whose tool-call markup did not parse (returned as plain text)."""
    tool_parse_error: str | None = None
    """the first of those errors."""
    issued: dict[str, int] = field(default_factory=dict)
    """tool call id -> index in `calls` of the call that made it."""
    finished: bool = False


@dataclass
class Job:
    """A request between `OpenAIServer.begin` and `finish`: what it asked for and its choices' futures."""

    log: EpisodeLog
    ids: list[int]
    parent: int | None
    text: str | None
    p: Params
    first: int
    futures: list = field(default_factory=list)
    updates: asyncio.Queue | None = None  # (choice, ids so far) while the engine generates: a live stream


def extends(ids: list[int], call: Call) -> int:
    """How many of `call`'s generated ids `ids` carries after `call.prompt_ids` + those ids as its prefix: all of them,
    those of its returned text (all but a trailing special stop token, or those before a stop string), or -1 when
    `ids` does not continue `call`."""
    n, gen = len(call.prompt_ids), call.token_ids
    if ids[:n] != call.prompt_ids:
        return -1
    if ids[n : n + len(gen)] == gen:
        return len(gen)
    if call.stop_text is not None:
        k = len(gen) - 1 if call.text_tokens is None else call.text_tokens
        if ids[n : n + k] == gen[:k]:
            return k
    return -1


def build_trajectory(calls: list[Call]) -> tuple[list[int], list[int], list[float], list[int], int]:
    """The trained trajectory of an episode from its recorded calls: the chain of parents ending at the last call
    (choice 0 of the last request when it asked for several choices).

    Returns (prompt_ids, token_ids, logprobs, action_mask, n_dropped): `prompt_ids` the chain's first prompt;
    `token_ids` everything after it, len R, with `logprobs` (R,) the engine's on generated tokens and 0.0 elsewhere,
    `action_mask` (R,) 1 on generated tokens and 0 on the tokens the prompts added between calls; `n_dropped` the
    calls outside the chain. Pure; `calls` must be non-empty."""
    chain = _chain(calls)
    prompt = calls[chain[0]].prompt_ids
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for j, k in enumerate(chain):
        c = calls[k]
        done = len(prompt) + len(tokens)
        assert c.prompt_ids[:done] == prompt + tokens, f"call {k} does not continue the chain it was recorded under"
        extra = c.prompt_ids[done:]  # template / tool / environment tokens between the calls: not trained on
        keep = _kept(calls, chain, j)
        tokens += extra + c.token_ids[:keep]
        logprobs += [0.0] * len(extra) + c.logprobs[:keep]
        mask += [0] * len(extra) + [1] * keep
    return list(prompt), tokens, logprobs, mask, len(calls) - len(chain)


def trajectory_routing(calls: list[Call]) -> torch.Tensor | None:
    """`--actor.routing-replay`: the routing table of `build_trajectory`'s prompt + tokens, joined from its chain's
    calls (`core.moe.joined_tables`): each call's rows up to its last kept token, from where its parent's stop. A
    position before a kept sampled token keeps the routing of the call that sampled it; the positions predicting the
    tokens between two calls (template, tool and environment tokens, and a parent's dropped stop token), that of the
    next call, the first to forward them. None when a call of the chain carries no table."""
    chain = _chain(calls)
    lengths = [len(calls[k].prompt_ids) + _kept(calls, chain, j) - 1 for j, k in enumerate(chain)]
    return moe.joined_tables([calls[k].routed_experts for k in chain], lengths)


def _chain(calls: list[Call]) -> list[int]:
    """The trained chain: the indices of the calls from the last call (choice 0 of the last request) back through its
    parents, in order."""
    end = len(calls) - 1
    while calls[end].choice > 0:  # a request's choices are recorded together, in order
        end -= 1
    chain = [end]
    while calls[chain[-1]].parent is not None:
        chain.append(calls[chain[-1]].parent)
    return chain[::-1]


def _kept(calls: list[Call], chain: list[int], j: int) -> int:
    """How many of chain call j's generated tokens the trajectory keeps: all for the last, else those its child
    carries."""
    c = calls[chain[j]]
    if j == len(chain) - 1:
        return len(c.token_ids)
    keep = extends(calls[chain[j + 1]].prompt_ids, c)
    assert keep >= 0, f"call {chain[j + 1]} does not continue its parent {chain[j]}"
    return keep
