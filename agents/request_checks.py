"""What the agent server (agents/openai_server.py) checks of a request before anything reaches the engine: the body
(size, content type, JSON, lone surrogates), the fields besides the prompt (`check_params` -> `Params`) and the
sampling values the engine accepts (`check_sampling`, `SAMPLING_RANGES`). A refused request is a `RequestError`
carrying its HTTP status (4xx; 5xx when the engine failed on it) and a message naming the field."""

import asyncio
import json
import math
import re
from dataclasses import dataclass, field

MODEL_ALIAS = "policy"
MAX_CHOICES = 128  # `n` at most (OpenAI's limit)
MAX_REQUEST_BYTES = 8 << 20  # a request body larger than this is refused (413) before it is parsed
INLINE_BYTES = 1 << 16  # bodies up to this are parsed and tokenized on the event loop (~1 ms); larger ones off it
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (vLLM seeds each request with it)
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's limit too)
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


class RequestError(Exception):
    """A request the server refuses (HTTP `status` 4xx) or could not answer (5xx: the engine failed on it), with
    `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Params:
    """What a request asks for besides its prompt (checked by `check_params`)."""

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


def bound(x: float) -> str:
    return {SEED_MIN: "-2**63", SEED_MAX: "2**64 - 1", math.inf: "inf"}.get(x, f"{x:g}")


def lone_surrogate(value) -> str | None:
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


def parse_body(raw: bytes):
    """The request body parsed as JSON (400 when it is not, or when a string in it is not text)."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError(400, "the request body is not valid JSON") from None
    where = lone_surrogate(body)
    if where is not None:
        raise RequestError(400, f"{where}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                "which is not text")  # fmt: skip
    return body


async def read_body(request, limit: int) -> tuple[object, int]:
    """The parsed JSON body and its size in bytes. A body over `limit` (the server's `max_request_bytes`) is refused (413) before it is
    parsed (it is still read to its end, so the client gets the answer instead of a reset connection); a large
    body is parsed in a worker thread."""
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
    return (parse_body(raw) if size <= INLINE_BYTES else await asyncio.to_thread(parse_body, raw)), size


def check_params(body, chat_request: bool, model_name: str, max_new_tokens: int) -> Params:
    """The request fields besides the prompt, checked."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model not in (model_name, MODEL_ALIAS):
        raise RequestError(404, f"the model {model!r} does not exist: this server serves {model_name!r} "
                                f"(alias {MODEL_ALIAS!r})")  # fmt: skip
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(400, f"max_tokens={limit!r}: must be a positive integer")
    p = Params(max_new_tokens if limit is None else min(limit, max_new_tokens))
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


def check_sampling(body) -> tuple[float, float, int | None]:
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
        bounds = f"{'(' if open_low else '['}{bound(low)}, {bound(high)}{']' if high < math.inf else ')'}"
        if isinstance(v, bool) or not isinstance(v, kind):
            raise RequestError(400, f"{name}={v!r}: must be {'an integer' if integer else 'a number'} in {bounds}")
        if not (math.isfinite(v) and (low < v if open_low else low <= v) and v <= high):
            raise RequestError(400, f"{name}={v!r}: must be in {bounds}")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return (1.0 if temperature is None else float(temperature), 1.0 if top_p is None else float(top_p),
            body.get("seed"))  # fmt: skip
