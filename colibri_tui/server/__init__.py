"""``coli serve``: the engine behind OpenAI- and Anthropic-compatible HTTP APIs.

Starlette (the ASGI toolkit FastAPI is built on, small and without a validation layer we would
not use) on uvicorn's pure-Python h11 server: SSE through StreamingResponse, a client's
disconnect seen by the response, and nothing compiled to carry in the one-file binary.
``app.py`` has the routes, ``worker.py`` the one generation thread and its bounded queue,
``params.py`` the field checks, ``metrics.py`` the Prometheus text.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys

from core.errors import ColiError

DEFAULT_PORT = 8080


def add_parser(sub, add_model) -> None:
    p = sub.add_parser("serve", help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
                       description="Serve the model: POST /v1/chat/completions, /v1/completions "
                                   "(OpenAI), /v1/messages (Anthropic), GET /v1/models, /health, "
                                   "/metrics. One request decodes at a time; --max-queue more wait.")
    add_model(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs --api-key or "
                        "--insecure-no-key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0: a free one, printed)")
    p.add_argument("--api-key", default=os.environ.get("COLI_API_KEY") or None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key: KEY) on every "
                        "route (default: $COLI_API_KEY)")
    p.add_argument("--insecure-no-key", action="store_true",
                   help="allow a non-loopback --host without an API key")
    p.add_argument("--max-queue", type=int, default=8, metavar="N",
                   help="requests that may wait behind the one decoding; past that 429 with "
                        "Retry-After (default 8)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; default: CORS off)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full; by default the caches of recent requests are "
                        "kept and a prompt starting like one of them prefills only the rest "
                        "(usage.prompt_tokens_details.cached_tokens, cache_read_input_tokens)")


def is_loopback(host: str) -> bool:
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ColiError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise ColiError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.api_key is not None and not args.api_key.strip():
        raise ColiError("--api-key is empty")
    if not is_loopback(args.host) and not args.api_key and not args.insecure_no_key:
        raise ColiError(f"--host {args.host} is reachable from other machines: give --api-key KEY "
                        f"(or $COLI_API_KEY), or --insecure-no-key to serve without one")


def listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        if os.name != "nt":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError as e:
        raise ColiError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def make_server(app):
    """A uvicorn server for the app (pure-Python h11, asyncio): SIGINT/SIGTERM cancel the
    generation in progress at once and answer waiting requests with a 503."""
    import uvicorn
    worker = app.state.serve.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                print("coli: stopping the server", file=sys.stderr, flush=True)
            worker.close(timeout=0)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, http="h11", loop="asyncio", lifespan="off", ws="none",
                                 interface="asgi3", log_level="warning", access_log=False,
                                 timeout_graceful_shutdown=3))


def serve(app, sock: socket.socket) -> None:
    """Run until SIGINT/SIGTERM on an already bound socket."""
    try:
        make_server(app).run(sockets=[sock])
    finally:
        app.state.serve.worker.close()


def cmd_serve(args, open_engine) -> int:
    check_args(args)
    from ..paths import logger
    from .app import build_app
    sock = listen(args.host, args.port)
    try:
        engine = open_engine(args)
        engine.warm_experts()       # the model fits: every expert read now, not at a client's first token
        app = build_app(engine, model_id=args.model_name, api_key=args.api_key, max_queue=args.max_queue,
                        cors_origins=args.cors_origin, log=logger("serve"))
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        state = app.state.serve
        print(f"coli: serving {state.model_id} at http://{shown}:{port}/v1 (OpenAI: /v1/chat/completions, "
              f"/v1/completions; Anthropic: /v1/messages; /health, /metrics); "
              f"{'API key required' if args.api_key else 'no API key'}; Ctrl+C stops",
              file=sys.stderr, flush=True)
        serve(app, sock)
    finally:
        sock.close()
    return 0
