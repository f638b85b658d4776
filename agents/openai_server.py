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

Where things live: this file holds the server (`OpenAIServer`: its lifecycle, episodes, prompts as token ids,
generation and recording, the FastAPI app); agents/request_checks.py what a request is checked for (`RequestError`,
`SAMPLING_RANGES`); agents/tool_calls.py the Hermes layout and its parser (`TOOL_PARSERS`), `render_chat`;
agents/records.py the records (`Call`, `EpisodeLog`) and `build_trajectory`; agents/batcher.py the batcher;
agents/responses.py the JSON answers and their log-probs; agents/streaming.py the server-sent events.
"""

import asyncio
import functools
import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable

from agents import request_checks, responses, streaming
from agents.batcher import Batcher
from agents.records import Call, EpisodeLog, Job, extends
from agents.request_checks import INLINE_BYTES, MAX_REQUEST_BYTES, SEED_MAX, Params, RequestError
from agents.tool_calls import (
    TOOL_PARSERS,
    ToolParseError,
    hermes_call_text,
    hermes_tools_prompt,
    render_chat,
    template_renders_tools,
)

SEED_STRIDE = 7_919  # sample k of an episode samples with seed + k · SEED_STRIDE
PIECE_CACHE = 512  # prompt pieces (the text from one added token to the next) whose ids the server keeps
PIECE_CACHE_CHARS = 16_384  # pieces longer than this are tokenized every time, not kept
PIECE_CHECKS = 16  # prompts tokenized both whole and by pieces before the pieces are trusted

log = logging.getLogger(__name__)


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
        self.bytes_of = responses.byte_decoder() if "ByteLevel" in repr(decoder) else None
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

        self._batcher = Batcher(self.engines, lambda: len(self.episodes))
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

    # -- episodes and prompts -----------------------------------------------------------------------------------------
    def _episode(self, eid: str) -> EpisodeLog:
        with self.lock:
            log = self.episodes.get(eid)
        if log is None:
            raise RequestError(404, f"unknown or finished episode {eid!r}: the episode's agent already returned, "
                                    "timed out, or the URL was not the one given to the agent")  # fmt: skip
        return log

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

    def decode(self, ids: list[int]) -> str:
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
                rest = c.text[len(self.decode(model)) :] + rest
        return c.prompt_ids + model + self._encode(rest, False), best

    @staticmethod
    def _parent_by_ids(log: EpisodeLog, ids: list[int]) -> int | None:
        matches = [(len(c.prompt_ids) + n, k) for k, c in enumerate(log.calls) if (n := extends(ids, c)) >= 0]
        return max(matches)[1] if matches else None

    def _messages(self, log: EpisodeLog, messages, p: Params) -> list[dict]:
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

    def chat_prompt(self, log: EpisodeLog, body: dict, p: Params | None = None) -> tuple[list[int], int | None, str]:
        p = p or Params(self.max_new_tokens)
        messages = self._messages(log, body.get("messages"), p)
        tools = p.tools if self.native_tools and p.tool_choice != "none" else None
        try:
            text = render_chat(self.tokenizer, messages, tools)
        except Exception as e:  # jinja2 TemplateError, or a template's raise_exception for an unsupported layout
            raise RequestError(400, f"the chat template refused the messages: {e}") from None
        ids, parent = self._prompt_from_text(log, text, special=False)
        return ids, parent, text

    def completion_prompt(self, log: EpisodeLog, body: dict,
                          p: Params | None = None) -> tuple[list[int], int | None, str | None]:  # fmt: skip
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
            text = self.decode(gen[:m])
            found = [(i + len(s), j, i) for j, s in enumerate(stops) if (i := text.find(s)) >= 0]
            return min(found) if found else None

        if not gen or first(len(gen)) is None:
            return None
        lo, hi = 1, len(gen)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if first(mid) is None else (lo, mid)
        return lo, first(lo)[2]

    def _record(self, sample, ids: list[int], parent: int | None, prompt_text: str | None, p: Params, request: int,
                choice: int) -> Call:  # fmt: skip
        """The Call of one sample: cut at a stop string, decoded, and its tool calls parsed."""
        gen, logprobs, reason = list(sample.token_ids), list(sample.logprobs), sample.finish_reason
        stop_text = text_tokens = None
        cut = self._cut_at_stop(gen, p.stops) if p.stops else None
        if cut is not None:
            m, start = cut
            gen, logprobs, reason = gen[:m], logprobs[:m], "stop"
            whole = self.decode(gen)
            text, stop_text = whole[:start], whole[start:]
            text_tokens = next(k for k in range(m - 1, -1, -1) if text.startswith(self.decode(gen[:k])))
        else:
            text = self.decode(gen)
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
                    content, tool_calls, error, None if top is None else top[: len(gen)],
                    getattr(sample, "routed_experts", None))  # fmt: skip

    async def generate(self, eid: str, request, chat_request: bool,
                       request_sampling: bool = False) -> tuple[list[Call], Params]:  # fmt: skip
        """Read and check the request, build the prompt ids (off the event loop for a large body), generate its
        choices (batched with concurrent requests) and record them: `begin` then `finish`."""
        job = await self.begin(eid, request, chat_request, request_sampling)
        return await self.finish(job), job.p

    async def begin(self, eid: str, request, chat_request: bool, request_sampling: bool = False) -> Job:
        """Read and check the request (RequestError: the answer is a 4xx), build the prompt ids and submit its choices
        to the batcher. `request_sampling` (the plain `/v1/...` routes): the request's temperature / top-p / seed
        replace the episode's and the rollout's. A stream that can go out as it is generated (`streaming.live`) gets the
        engine's progress in `job.updates`."""
        log = self._episode(eid)
        top_p = self.top_p
        try:
            body, size = await request_checks.read_body(request, self.max_request_bytes)
            temperature, request_top_p, seed = request_checks.check_sampling(body)
            if request_sampling:
                log.temperature, top_p, log.seed = temperature, request_top_p, seed
            p = request_checks.check_params(body, chat_request, self.model_name, self.max_new_tokens)
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
        job = Job(log, ids, parent, text, p, first)
        if streaming.live(p):
            loop, job.updates = asyncio.get_running_loop(), asyncio.Queue()

            def listener(j: int) -> Callable[[list[int]], None]:
                return lambda got: loop.call_soon_threadsafe(job.updates.put_nowait, (j, got))

        job.futures = [self._batcher.submit(ids, min(p.limit, room), log.temperature, top_p, s, tuple(p.stops),
                                            p.top_logprobs, listener(j) if job.updates is not None else None)
                       for j, s in enumerate(seeds)]  # fmt: skip
        return job

    async def finish(self, job: Job) -> list[Call]:
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

        async def live(job: Job, chat: bool, done: Callable[[], None] | None = None):
            pending, news = await streaming.first_news(self, job)
            return StreamingResponse(streaming.stream_live(self, job, chat, pending, news, done), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip

        async def answer(eid: str, request: Request, chat: bool):
            job = await self.begin(eid, request, chat_request=chat)
            if job.updates is not None:
                return await live(job, chat)
            calls, p = await self.finish(job), job.p
            if p.stream:
                return streaming.event_stream(streaming.stream(self, calls, p, chat))
            return JSONResponse(
                responses.chat_response(self, calls, p) if chat else responses.completion_response(self, calls, p)
            )

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
                return streaming.event_stream(streaming.stream(self, calls, p, chat))
            return JSONResponse(
                responses.chat_response(self, calls, p) if chat else responses.completion_response(self, calls, p)
            )

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
