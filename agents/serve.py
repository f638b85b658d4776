"""`python -m agents.openai_server --model <run>/hf [--port 8000]` (also `python -m agents.serve`): serve an exported
model for evaluation with the OpenAI API the RL agents use (docs/agents.md, "Serving a checkpoint").

This file is the command only: its flags (`serve_parser`), the checks made before anything loads (`is_loopback`,
`check_weight_files`), the start line (`listen_url`) and `serve`, which loads the engine and runs the server class
of agents/openai_server.py (`OpenAIServer`, its `/v1/...` routes) until SIGINT / SIGTERM. The imports go one way:
this module imports agents/openai_server.py, which never imports it (its `__main__` hands the documented command
over to this file with `runpy`).

Each `/v1/...` request is an episode of its own, sampled at its own temperature / top_p / seed and recorded nowhere.
With `--api-key KEY` (or CLEANRLHF_API_KEY) every request must carry `Authorization: Bearer KEY`; a `--host` other
machines reach needs a key or `--no-auth`.
"""

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from agents.openai_server import OpenAIServer

KEY_ENV = "CLEANRLHF_API_KEY"  # `serve`'s key when --api-key is not given


def serve_parser():
    """The flags of `python -m agents.openai_server` (see `serve`)."""
    parser = argparse.ArgumentParser(prog="python -m agents.openai_server",
                                     description="Serve an exported model (an HF folder, e.g. <run>/hf) with the "
                                                 "OpenAI API the RL agents use, for evaluation: /v1/models, "
                                                 "/v1/chat/completions, /v1/completions.")  # fmt: skip
    parser.add_argument("--model", required=True, help="the model folder (config.json, weights, tokenizer), or an "
                                                       "embedded name such as cleanrlhf/tiny-chat")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                        help="vllm: vLLM in this process; hf: transformers' generate (slow)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer at most (a request's "
                                                                         "max_tokens may ask for fewer)")  # fmt: skip
    parser.add_argument("--max-context", type=int, help="prompt + answer in tokens at most (default: the model's "
                                                        "max_position_embeddings)")  # fmt: skip
    parser.add_argument("--served-name", default=None,
                        help="the name /v1/models lists and requests give as `model` (the alias `policy` works "
                             "too); default --model")  # fmt: skip
    parser.add_argument("--api-key", default=None,
                        help=f"the key every request must carry as `Authorization: Bearer KEY` (the OpenAI client's "
                             f"api_key; 401 without it); default: the environment variable {KEY_ENV}, which keeps "
                             f"it out of `ps`")  # fmt: skip
    parser.add_argument("--no-auth", action="store_true",
                        help="serve a --host other machines can reach without a key (anyone who reaches the port "
                             "can use the model); without a key such a --host is refused")  # fmt: skip
    parser.add_argument("--log-dir", default="runs",
                        help="folder of the log file that takes the libraries' messages (openai_server.<time>.<pid>"
                             ".log)")  # fmt: skip
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's, torch's and transformers' messages here instead of in a log file")  # fmt: skip
    return parser


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host`: `localhost` or a loopback address (127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def listen_url(sock: socket.socket) -> tuple[str, str]:
    """(the URL of the address `sock` is bound to, who can reach it), for the start line."""
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    address = ipaddress.ip_address(host)
    if address.is_unspecified:
        return url, f"every interface of this machine; here: http://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"
    return url, "this machine only" if address.is_loopback else "other machines too"


def check_weight_files(path: str, flag: str, name: str) -> None:
    """A ValueError naming the first `*.safetensors` file under `path` that does not open (truncated by a full disk
    or an interrupted copy): vLLM would fail on it deep inside its loader."""
    from safetensors import safe_open

    for file in sorted(Path(path).expanduser().glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as e:  # noqa: BLE001  (each safetensors error names what is wrong with the file)
            raise ValueError(f"{flag} {name}: damaged weights file {file} ({e}); export or copy the model "
                             "again") from None  # fmt: skip


def serve(argv: list[str] | None = None) -> int:
    """Serve `--model` until SIGINT / SIGTERM, then stop cleanly (exit 0). Each `/v1/...` request is its own
    throwaway episode: sampled at its own temperature / top_p / seed (OpenAI's defaults: 1, 1, none), recorded
    nowhere; a request the engine fails on is answered 500 and the server goes on. User mistakes (a `--model` that is
    no model folder or has a damaged weights file, a port in use or out of range, a `--max-context` beyond the
    model's, a `--host` other machines reach without a key) exit 2 with one line naming the flag, before the model is
    loaded. vLLM's, torch's and transformers' messages go to a log file (`core.noise`; `--verbose` shows them)."""
    from core import embedded, noise

    parser = serve_parser()
    args = parser.parse_args(argv)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--max-context", args.max_context)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be a positive integer")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be from 0 to 65535 (0: any free port)")
    key = args.api_key if args.api_key is not None else (os.environ.get(KEY_ENV) or None)
    if key is not None and not key.strip():
        parser.error(f"--api-key {key!r}: an empty key would let anyone in; give a key, or leave the flag out")
    if key is None and not args.no_auth and not is_loopback(args.host):
        parser.error(f"--host {args.host}: other machines can reach it, and no key is set: give --api-key KEY (or set "
                     f"{KEY_ENV}), or --no-auth to serve anyone who can reach the port")  # fmt: skip
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        parser.error(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); is another "
                     "server running? Pick another --port")  # fmt: skip
    if key is None and not is_loopback(sock.getsockname()[0]) and not args.no_auth:  # a name that resolved outward
        parser.error(f"--host {args.host}: resolves to {sock.getsockname()[0]}, which other machines can reach, and "
                     f"no key is set: give --api-key KEY (or set {KEY_ENV}), or --no-auth")  # fmt: skip
    if not args.model.startswith(embedded.PREFIX) and not (Path(args.model).expanduser() / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model folder ({args.model} has no config.json); give the folder an "
                     "export wrote, e.g. <run>/hf")  # fmt: skip
    log_dir = str(Path(args.log_dir).expanduser().absolute())  # absolute: a log left empty by a refusal is removed
    logged = noise.quiet_libraries(["--exp-name", "openai_server", "--logger.run-root", log_dir, "--logger.quiet"]
                                   + (["--logger.verbose"] if args.verbose else []))  # fmt: skip
    if logged is not None:
        print(f"[openai_server] library messages: {logged} (--verbose shows them here)", flush=True)
    path = embedded.resolve_model(args.model)
    if not (Path(path).expanduser() / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model folder ({path} has no config.json); give the folder an "
                     "export wrote, e.g. <run>/hf")  # fmt: skip
    from core import models, rollout  # torch and vLLM: imported once the flags are known to be good

    try:
        tokenizer = models.load_tokenizer(path, "--model")
        longest = models.max_positions(path, "--model")
        check_weight_files(path, "--model", args.model)
    except ValueError as e:
        parser.error(str(e))
    if longest is not None and args.max_context is not None and args.max_context > longest:
        parser.error(f"--max-context {args.max_context}: the model {args.model} holds {longest} tokens "
                     "(max_position_embeddings): give at most that, or leave the flag out")  # fmt: skip
    max_context = args.max_context or longest
    if max_context is None:
        parser.error(f"--model {args.model}: its config names no context length: give --max-context")
    cfg = rollout.VLLMConfig(engine=args.engine, max_model_len=max_context)
    try:
        engines = rollout.create_engines(path, cfg, seed=0)
    except (ValueError, rollout.EngineError) as e:
        print(f"python -m agents.openai_server: error: --model {args.model}: the {args.engine} engine could not load "
              f"it: {e}", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    server = OpenAIServer(engines, tokenizer, args.served_name or args.model, args.max_new_tokens, max_context,
                          api_key=key)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start(sock=sock)
    url, reach = listen_url(sock)
    who = "requests need the key (Authorization: Bearer KEY)" if key else "no key"
    print(f"serving {args.model} as {server.model_name!r} at {url}/v1 ({reach}; {who}; {args.engine}; Ctrl-C "
          "stops)", flush=True)  # fmt: skip
    while not stop.wait(0.5):
        pass
    server.close()
    engines.shutdown()
    failed, error = server.engine_failures
    print(f"stopped{f' ({failed} requests the engine failed on, answered 500; the last: {error!r})' if failed else ''}",
          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
