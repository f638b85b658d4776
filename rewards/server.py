"""HTTP reward server: scores batches of texts with a reward model trained by `algos/rm.py` (or any
`AutoModelForSequenceClassification` with one label), for the RL scripts' `--reward.remote-url`.

    POST /get_reward   {"query": ["37+45=82", ...], "prompts": [...], "labels": [...]}
                    -> {"rewards": [1.7, ...], "scores": [1.7, ...]}
    GET  /health    -> {"status": "ok", "model": ..., "normalize": ...}

Several reward models as named parts (`--components correct=runs/rm_a/hf style=runs/rm_b/hf`, for algos/gdpo.py,
which normalises each part apart): every text is scored by each component model, and the answer carries their scores
by name, in the order the flag gives them. `rewards` (= `scores`) is then `--model`'s score if `--model` is given too,
else the sum of the parts:

    POST /get_reward   {"query": [...]}
                    -> {"rewards": [2.1, ...], "scores": [2.1, ...], "components": {"correct": [1.7, ...],
                                                                                    "style": [0.4, ...]}}
    GET  /health    -> {"status": "ok", "model": null, "normalize": ..., "components": {"correct": "runs/rm_a/hf",
                                                                                         "style": "runs/rm_b/hf"}}

The request and response follow OpenRLHF's remote reward-model contract: `query` holds the full texts (prompt +
response, as the policy saw them); `prompts` and `labels` are optional and, when given, must have one entry per
query (a rule or hybrid server could use them; this one scores `query` alone). Each text is tokenized in one piece
with an eos appended (`core.data.reward_ids`, exactly as `algos/rm.py` trained) and scored at its last token. With
`--normalize` a score is (r − reward_mean) / reward_std, the held-out statistics `algos/rm.py` saved in config.json
(each model's own: a component's part, and so the parts' sum, is of normalized scores).

Errors: a body that is not JSON or has the wrong shape -> 422 with pydantic's description of the offending field;
mismatched list lengths, too many texts or an over-long text -> 400 naming the field and index. A bad request never
stops the server. A fault of the server itself while scoring (the model's forward failing, ...) -> 500 naming it
(the RL scripts' client retries a 5xx, never a 4xx). The server's own flags are checked at start, before the model
loads (`check_server_args`). A text is over-long past `--max-len` or the model's own `max_position_embeddings`, whichever is
smaller: the model has no positions for more.

Bounded work: each request is scored in a worker thread that checks a cancel event before it takes the model and
between forward batches (`--batch-size` texts each). The event is set when the request's time runs out
(`--request-timeout-s`: the client gets 504), when its client disconnects (a client that timed out and retries does
not leave the abandoned job computing ahead of the retry), and on SIGTERM / SIGINT, so the server stops within a
forward batch and a few seconds of grace (in-flight requests get 503).

Access: with a key (`--api-key KEY`, or the environment variable CLEANRLHF_API_KEY, which keeps it out of `ps`)
every request must carry `Authorization: Bearer KEY` (401 otherwise; the RL scripts' client sends the key held by
the variable `--reward.api-key-env` names, CLEANRLHF_API_KEY by default). A bind to anything but loopback without a
key is refused at start unless `--no-auth` says to serve anyone who can reach the port. A POST whose body is not
`application/json` gets 415, so a web page cannot send the server a "simple" cross-origin request. The start line
names the address the server really listens on.

Run:
    python -m rewards.server --model runs/rm__1__<time>/hf --normalize --port 5000
    CLEANRLHF_API_KEY=... python -m rewards.server --model runs/rm__1__<time>/hf --host 0.0.0.0
    python -m rewards.server --components correct=runs/rm_a/hf style=runs/rm_b/hf --normalize   # for algos/gdpo.py
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, fields

import torch
import tyro
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from core import data, models
from core.flags import ModelPath, PosInt


@dataclass
class ServerArgs:
    model: ModelPath | None = None
    """reward model folder (an `algos/rm.py` export) or hub id; its score is the answer's `rewards`. Needed unless
    `--components` is given."""
    components: tuple[str, ...] = ()
    """reward models served as named parts, NAME=PATH each (`correct=runs/rm_a/hf style=runs/rm_b/hf`; a NAME is an
    identifier): each text is scored by every one, the answer's `components` holds their scores by name (what
    algos/gdpo.py normalises apart), and its `rewards` is `--model`'s score if given, else the sum of the parts."""
    host: str = "127.0.0.1"
    """interface to bind; 0.0.0.0 serves other machines (then a key is needed, or `--no-auth`)."""
    port: int = 5000
    """TCP port."""
    normalize: bool = False
    """serve (r − reward_mean) / reward_std with the statistics saved in the model's config.json."""
    batch_size: PosInt = 64
    """texts per forward pass."""
    max_len: PosInt = 2048
    """reject texts longer than this many tokens (400), rather than truncate them silently; the model's
    `max_position_embeddings` caps it."""
    max_texts: int = 4096
    """reject requests with more texts than this (400)."""
    request_timeout_s: float = 60.0
    """seconds one request may take, waiting for the model included; past it scoring stops and the client gets 504
    (the default matches the RL scripts' `--reward.timeout-s`, after which they stop waiting anyway). 0: no limit."""
    dtype: str = "auto"
    """`auto` (bf16 on GPU, fp32 on CPU), `bf16` or `fp32`."""
    api_key: str | None = None
    """the key every request must carry as `Authorization: Bearer KEY` (401 without it). Default: the environment
    variable CLEANRLHF_API_KEY if set, which is better: a key on the command line shows in `ps`."""
    no_auth: bool = False
    """serve a `--host` other than loopback without a key: anyone who can reach the port can use the server."""


KEY_ENV = "CLEANRLHF_API_KEY"
"""the environment variable holding the key when `--api-key` is not given."""


def server_key(args: ServerArgs) -> str | None:
    """The key requests must carry: `--api-key`, else $CLEANRLHF_API_KEY, else None (no key)."""
    return args.api_key if args.api_key is not None else (os.environ.get(KEY_ENV) or None)


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host`: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


DTYPES = ("auto", "bf16", "fp32")


def parse_components(specs: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """`--components NAME=PATH ...` as {name: path} in the order given, and one error per spec that is not one (each
    naming the flag and the spec as typed)."""
    parts, errors = {}, []
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not eq:
            errors.append(f"--components {spec}: expected NAME=PATH, e.g. correct=runs/rm_a/hf")
        elif not name:
            errors.append(f"--components {spec}: the name before '=' is empty")
        elif not name.isidentifier():
            errors.append(f"--components {spec}: the name {name!r} is not an identifier (letters, digits and _, not "
                          "starting with a digit)")  # fmt: skip
        elif not path:
            errors.append(f"--components {spec}: the path after '=' is empty")
        elif name in parts:
            errors.append(f"--components {spec}: the name {name!r} is given twice; each part needs its own name")
        else:
            parts[name] = path
    return parts, errors


def check_server_args(args: ServerArgs) -> None:
    """The server's flags, checked before anything loads: a server that starts must be able to answer. One
    ValueError lists every bad flag, each as typed (`--batch-size 0: must be > 0`)."""
    errors = []
    for f in fields(args):
        value, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if f.name in ("batch_size", "max_len", "max_texts") and value < 1:
            errors.append(f"{flag} {value}: must be > 0")
        elif f.name == "port" and not 1 <= value <= 65535:
            errors.append(f"{flag} {value}: must be a TCP port, 1 to 65535")
        elif f.name == "request_timeout_s" and not (math.isfinite(value) and value >= 0):
            errors.append(f"{flag} {value}: must be a finite number of seconds >= 0 (0: no limit)")
        elif f.name == "dtype" and value not in DTYPES:
            errors.append(f"{flag} {value}: must be one of {', '.join(DTYPES)}")
        elif f.name == "api_key" and value is not None and not value.strip():
            errors.append(f"{flag} {value!r}: an empty key would let anyone in; give a key, or leave the flag out")
        elif f.name == "components":
            errors += parse_components(value)[1]
    if args.model is None and not args.components:
        errors.append("--model / --components: no reward model to serve: give --model PATH, --components NAME=PATH "
                      "..., or both")  # fmt: skip
    key = server_key(args)
    if key is None and not args.no_auth and not is_loopback(args.host):
        errors.append(f"--host {args.host}: other machines can reach it, and no key is set: give --api-key KEY (or set "
                      f"{KEY_ENV}), or --no-auth to serve anyone who can reach the port")  # fmt: skip
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError("invalid flags:\n  " + "\n  ".join(errors))


GRACE_S = 3.0
"""on SIGTERM / SIGINT, seconds uvicorn waits for in-flight requests (told to stop) before cancelling them."""
POLL_S = 0.1
"""how often a waiting request checks its time limit and whether its client is still connected."""


class ScoringCancelled(Exception):
    """The request's cancel event was set: its time ran out, its client left, or the server is shutting down."""


class TextTooLong(ValueError):
    """A text of the request has more tokens than the model takes: the client's mistake (400)."""


class RewardRequest(BaseModel):
    query: list[str]
    prompts: list[str] | None = None
    labels: list | None = None


class RewardScorer:
    """The model, tokenizer and normalization; `scorer(texts)` returns one float per text (thread-safe). `max_len`
    is capped by the model's `max_position_embeddings` (`n_positions` for GPT-2-like configs)."""

    def __init__(self, path: str, normalize: bool = False, batch_size: int = 64, max_len: int = 2048,
                 dtype: str = "auto", device: str | None = None, load_in_4bit: bool = False):  # fmt: skip
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = models.load_scalar_model(path, dtype, load_in_4bit=load_in_4bit)  # 4-bit: on its device already
        self.model = (self.model if load_in_4bit else self.model.to(self.device)).eval()
        self.tokenizer = models.load_tokenizer(path)
        config = self.model.config
        if getattr(config, "vision_config", None) is not None:  # its texts would be scored without their pictures
            raise ValueError(f"{path}: a vision-language reward model (rm.py --data.image-key); this server scores "
                             "texts only and would score them without their pictures: score it in Python with "
                             "algos/rm.py's `padded_scores(..., pictures)`")  # fmt: skip
        self.add_special_tokens = getattr(config, "reward_add_special_tokens", True)
        self.mean, self.std = 0.0, 1.0
        if normalize:
            if getattr(config, "reward_mean", None) is None or getattr(config, "reward_std", None) is None:
                raise ValueError(f"{path}: --normalize needs reward_mean / reward_std in config.json (algos/rm.py "
                                 "writes them); serve without --normalize")  # fmt: skip
            self.mean, self.std = float(config.reward_mean), max(float(config.reward_std), 1e-8)
        self.positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self.max_len = max_len if self.positions is None else min(max_len, int(self.positions))
        self.path, self.normalize, self.batch_size, self.requested_max_len = path, normalize, batch_size, max_len
        self.lock = threading.Lock()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Tokenize; `TextTooLong` (a ValueError) naming the index of the first over-long text."""
        ids = [data.reward_ids(self.tokenizer, t, self.add_special_tokens) for t in texts]
        for i, x in enumerate(ids):
            if len(x) > self.max_len:
                why = (f" (the model's max_position_embeddings; --max-len is {self.requested_max_len})"
                       if self.max_len < self.requested_max_len else "")  # fmt: skip
                raise TextTooLong(f"query[{i}]: {len(x)} tokens > max_len {self.max_len}{why}")
        return ids

    @torch.no_grad()
    def __call__(self, texts: list[str], cancel: threading.Event | None = None) -> list[float]:
        """One score per text. `cancel`, once set, stops the call with `ScoringCancelled` before it takes the model
        or between forward batches, leaving the model to the next caller."""
        ids, out = self.token_ids(texts), []
        pad = self.tokenizer.pad_token_id
        while not self.lock.acquire(timeout=POLL_S):  # one forward at a time: each request has its own thread
            if cancel is not None and cancel.is_set():
                raise ScoringCancelled
        try:
            for i in range(0, len(ids), self.batch_size):
                if cancel is not None and cancel.is_set():
                    raise ScoringCancelled
                chunk = ids[i : i + self.batch_size]
                width = max(len(x) for x in chunk)
                input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in chunk], device=self.device)
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], device=self.device)
                scores = models.sequence_scores(self.model, input_ids, mask)
                out += ((scores - self.mean) / self.std).tolist()
        finally:
            self.lock.release()
        return out


class Guard:
    """ASGI middleware in front of every route: 401 without the key (`Authorization: Bearer KEY`, compared in
    constant time), then 415 for a POST whose body is not `application/json` (a form or text/plain is what a web page
    may send across origins without asking first). A plain ASGI class: starlette's `BaseHTTPMiddleware` would change
    how the routes see a client disconnect and a shutdown."""

    def __init__(self, app, api_key: str | None = None):
        self.app, self.expected = app, (None if api_key is None else f"Bearer {api_key}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])  # lower-case byte names
            if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                answer = JSONResponse({"detail": "missing or wrong key: send the header 'Authorization: Bearer KEY'"},
                                      status_code=401, headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                return await answer(scope, receive, send)
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
            if scope["method"] == "POST" and kind != "application/json":
                answer = JSONResponse({"detail": f"the body is {kind or 'of no content-type'!r}: send application/json"},
                                      status_code=415)  # fmt: skip
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(scorer: RewardScorer | None, max_texts: int = 4096, request_timeout_s: float = 60.0,
               api_key: str | None = None, components: dict[str, RewardScorer] | None = None) -> FastAPI:  # fmt: skip
    """The FastAPI app. `app.state.cancel_all()` stops every in-flight request's scoring and answers new ones 503
    (the server is shutting down). With `api_key`, every request must carry it as a Bearer token (401). With
    `components` ({name: scorer}), each answer carries every component's scores by name, and `rewards` is `scorer`'s
    scores, or without `scorer` the sum of the components' (in their order)."""
    parts = dict(components or {})
    assert scorer is not None or parts, "create_app needs a scorer, components, or both"
    app = FastAPI(title="CleanRLHF reward server")
    app.add_middleware(Guard, api_key=api_key)
    in_flight: set[threading.Event] = set()
    closing = threading.Event()

    def cancel_all() -> None:
        closing.set()
        for event in list(in_flight):
            event.set()

    app.state.cancel_all = cancel_all

    def score(texts: list[str], cancel: threading.Event) -> dict:
        """The answer to `texts`: `scorer`'s scores and each component's, one model after the other (a model served
        twice, by one path, scores once)."""
        by_model = {} if scorer is None else {id(scorer): scorer(texts, cancel)}
        scored = {}
        for name, part in parts.items():
            try:
                scored[name] = by_model[id(part)] if id(part) in by_model else part(texts, cancel)
            except TextTooLong as e:  # the components' models may take different lengths: say whose it was
                raise TextTooLong(f"component {name!r} ({part.path}): {e}") from None
            by_model[id(part)] = scored[name]
        # without --model, the parts' sum, added in the flag's order
        rewards = by_model[id(scorer)] if scorer is not None else [sum(x) for x in zip(*scored.values())]
        return {"rewards": rewards, "scores": rewards, **({"components": scored} if parts else {})}

    @app.get("/health")
    def health() -> dict:
        normalize = (scorer or next(iter(parts.values()))).normalize  # one flag for every model
        served = {"components": {name: part.path for name, part in parts.items()}} if parts else {}
        return {"status": "ok", "model": None if scorer is None else scorer.path, "normalize": normalize, **served}

    @app.post("/get_reward")
    async def get_reward(req: RewardRequest, request: Request) -> dict:
        n = len(req.query)
        for name, values in (("prompts", req.prompts), ("labels", req.labels)):
            if values is not None and len(values) != n:
                raise HTTPException(400, f"{name!r} has {len(values)} entries but 'query' has {n}: one per query")
        if n > max_texts:
            raise HTTPException(400, f"{n} texts in one request > max_texts {max_texts}: split the batch")
        if n == 0:
            return {"rewards": [], "scores": [], **({"components": {name: [] for name in parts}} if parts else {})}
        if closing.is_set():
            raise HTTPException(503, "the reward server is shutting down")
        cancel = threading.Event()
        in_flight.add(cancel)
        try:
            answer = await score_in_thread(req.query, cancel, request)
        except TextTooLong as e:  # the client's mistake
            raise HTTPException(400, str(e)) from None
        except (ScoringCancelled, asyncio.CancelledError):  # the latter: a forward outlasted the shutdown's grace
            raise HTTPException(503, "the reward server is shutting down: request not scored") from None
        except HTTPException:  # 504 (time limit) and 499 (client gone), decided while waiting
            raise
        except Exception as e:  # the server's own fault (the model's forward, ...): 5xx, which a client may retry
            traceback.print_exception(e, file=sys.stderr)
            raise HTTPException(500, f"the reward server failed while scoring: {type(e).__name__}: {e}") from None
        finally:
            cancel.set()  # a request cancelled by the server (shutdown) stops its worker too
            in_flight.discard(cancel)
        return answer

    async def score_in_thread(texts: list[str], cancel: threading.Event, request: Request) -> dict:
        """`score(texts, cancel)` in a daemon thread (one that never finishes cannot hold up the exit), waited for
        while checking the time limit and the client; either sets `cancel` and answers at once."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result: tuple) -> None:
            if not done.done():
                done.set_result(result)

        def work() -> None:
            try:
                result = (score(texts, cancel), None)
            except BaseException as e:  # handed to the request below
                result = (None, e)
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:  # the event loop is closed: the server has stopped
                pass

        threading.Thread(target=work, name="reward-scoring", daemon=True).start()
        deadline = loop.time() + request_timeout_s if request_timeout_s > 0 else float("inf")
        while not done.done():
            await asyncio.wait([done], timeout=max(min(POLL_S, deadline - loop.time()), 0))
            if done.done():
                break
            if loop.time() >= deadline:
                cancel.set()
                raise HTTPException(504, f"scoring {len(texts)} texts took longer than --request-timeout-s "
                                         f"{request_timeout_s:g} s (waiting for the model included) and was stopped: "
                                         "send fewer texts per request or raise the limit")  # fmt: skip
            if await request.is_disconnected():
                cancel.set()
                raise HTTPException(499, "the client disconnected: scoring stopped")  # nobody reads this
        answer, error = done.result()
        if error is not None:
            raise error
        return answer

    return app


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (`host`, `port`), not listening yet (clients are refused until the model is loaded); a
    ValueError naming the flags when the address cannot be had (in use, not this machine's, ...)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    return sock


def start_line(sock: socket.socket, key: str | None) -> str:
    """What the server prints at start: the address it really listens on, and who may use it."""
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    if ipaddress.ip_address(host).is_unspecified:
        where = f"every interface of this machine, e.g. http://{socket.gethostname()}:{port}"
    else:
        where = "this machine only" if ipaddress.ip_address(host).is_loopback else "other machines too"
    who = "requests need the key (Authorization: Bearer KEY)" if key else "no key: anyone who can reach it"
    return f"reward server listening on {url} ({where}; {who}); POST {url}/get_reward"


def load_scorers(args: ServerArgs) -> tuple[RewardScorer | None, dict[str, RewardScorer]]:
    """`--model`'s scorer (None without it) and `--components`' {name: scorer}, each with the flags' normalization
    and sizes; a path named twice is loaded once."""
    loaded: dict[str, RewardScorer] = {}

    def scorer_of(path: str) -> RewardScorer:
        if path not in loaded:
            loaded[path] = RewardScorer(path, args.normalize, args.batch_size, args.max_len, args.dtype)
        return loaded[path]

    parts, errors = parse_components(args.components)
    assert not errors, errors  # check_server_args refused them
    return (None if args.model is None else scorer_of(args.model)), {name: scorer_of(p) for name, p in parts.items()}


def main(args: ServerArgs) -> None:
    check_server_args(args)  # before the model loads: a server that starts can answer
    import uvicorn

    key = server_key(args)
    sock = bind(args.host, args.port)  # a port in use is named before the model loads
    scorer, components = load_scorers(args)
    app = create_app(scorer, args.max_texts, args.request_timeout_s, key, components)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM / SIGINT: stop in-flight scoring now, then shut down
            app.state.cancel_all()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACE_S)
    print(start_line(sock, key), flush=True)
    Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(tyro.cli(ServerArgs))
