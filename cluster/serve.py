"""`pdserve serve`: start (or join) Ray, start the worker pools, serve HTTP.

The HTTP port is bound first, before Ray and the workers start: a busy port fails in
a second rather than after the workers' start-up, and nothing that Ray or the workers
open meanwhile (their connections take ephemeral ports) can take it. `--port 0` binds
a free port and announces it.

Shutdown on Ctrl-C / SIGTERM drains (`cluster.drain`): the listening socket closes at
once, so new connections are refused and a load balancer's health check fails; requests
in flight run to their end for up to `--drain-timeout-s`; whatever still runs then ends
with a 503 error (each request aborted on its workers, its KV freed); then the workers
are shut down, and Ray stopped if we started it. A second signal cuts at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket

from cluster.config import ClusterConfig
from cluster.config_flags import add_config_flags, config_overrides
from cluster.request_limits import add_limit_flags, limits_from_args
from engine import envs
from engine.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DRAIN_TIMEOUT_S = 25.0
CUT_GRACE_S = 5.0
"""After the drain's cut, how long uvicorn waits for the cut requests' last bytes before
it cancels their tasks (a client that stopped reading holds its send)."""


def add_serve_parser(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API over prefill and decode worker pools",
        description="Start (or join) a Ray cluster, start prefill and decode workers, and serve "
        "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health "
        "and /metrics. Every ClusterConfig key is a flag; flags override the YAML --config "
        "file (see docs/operations.md).",
    )
    parser.add_argument("--config", help="YAML file with ClusterConfig keys")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument(
        "--port",
        type=int,
        default=8000,
        help="HTTP port; 0 binds a free one and prints it (default: 8000)",
    )
    parser.add_argument(
        "--api-key", default=None, help="require this bearer key (or PDSERVE_API_KEY)"
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        help="requests admitted at once; past it, 429 with Retry-After (default: 256)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="on SIGTERM or Ctrl-C: refuse new connections, let requests in flight finish for "
        "up to this many seconds, then cut the rest and stop (a second signal stops at once; "
        f"default: {DRAIN_TIMEOUT_S:g}, under Kubernetes' 30 s grace period)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["none", *TOOL_PARSERS],
        help="how answers to chat requests with tool_choice 'auto' are read for tool calls: "
        "'hermes' (<tool_call>{...}</tool_call> JSON blocks) or 'none' (plain content) "
        "(default: hermes)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients may give as 'model'; the first is the one /v1/models lists "
        "(default: the model's own name, e.g. SmolLM2-135M-Instruct for demo)",
    )
    add_config_flags(parser, ClusterConfig, skip={"cluster_token"})
    add_limit_flags(parser)
    parser.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig.load(args.config, config_overrides(args, ClusterConfig))


def run_serve(args: argparse.Namespace) -> int:
    from cluster.frontend import FrontendSettings

    config = config_from_args(args)
    settings = FrontendSettings(
        api_key=args.api_key or envs.api_key(),
        max_in_flight=args.max_in_flight,
        tool_call_parser=args.tool_call_parser,
        served_model_names=tuple(args.served_model_name or ()),
        limits=limits_from_args(args),
    )
    if args.host not in LOOPBACK_HOSTS and not settings.api_key:
        logger.warning(
            "serving on %s without an API key: anyone who can reach this address can use "
            "the model; pass --api-key (or set PDSERVE_API_KEY)",
            args.host,
        )
    if args.drain_timeout_s < 0:
        raise SystemExit("pdserve serve: --drain-timeout-s must be >= 0")
    listener = bind_listener(args.host, args.port)
    with listener:
        asyncio.run(_serve(config, settings, args.host, listener, args.drain_timeout_s))
    return 0


def bind_listener(host: str, port: int) -> socket.socket:
    """Binds (without listening: a client meanwhile is refused, not left hanging) the
    socket the HTTP server will serve on; `run_serve` calls it before the cluster starts.
    Raises SystemExit with the address and the reason when the port cannot be had."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    # A server restarted on its port must not wait out the last one's TIME_WAIT sockets.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise SystemExit(
            f"pdserve serve: cannot listen on {host}:{port}: {error.strerror} "
            "(another server there? pick another --port, or --port 0 for a free one)"
        ) from error
    return sock


async def _serve(
    config: ClusterConfig, settings, host: str, listener: socket.socket, drain_timeout_s: float
) -> None:
    from cluster.cluster import PDCluster
    from cluster.frontend import build_app

    port = listener.getsockname()[1]
    cluster = PDCluster(config)
    logger.info("starting %s cluster (%s): %s", config.mode, cluster.model_id, _pools(config))
    await cluster.start()
    try:
        app = build_app(cluster, settings)
        server = _draining_server(app, drain_timeout_s)
        name = app.state.handler.model_name
        app.router.on_startup.append(lambda: _announce(host, port, name))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)
        await server.serve(sockets=[listener])
    finally:
        logger.info("shutting down workers")
        await cluster.shutdown()


def _draining_server(app, drain_timeout_s: float):
    """uvicorn's server, told to stop by our signal handlers rather than its own (it
    re-raises SIGINT/SIGTERM after serving, which would kill this process before the
    workers and Ray are shut down). A first signal starts the frontend's drain and
    uvicorn's graceful shutdown (no new connections; it waits for the open ones); a
    second one cuts what runs at once."""
    import uvicorn

    handler = app.state.handler

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def request_exit(self) -> None:
            if self.should_exit:
                logger.info("second signal: ending %d requests in flight now", handler.in_flight)
                handler.drain.cut_now()
                self.force_exit = True
            else:
                logger.info(
                    "stopping: new connections refused; %d requests in flight get up to %g s",
                    handler.in_flight,
                    drain_timeout_s,
                )
                handler.drain.begin(drain_timeout_s)
            self.should_exit = True

    grace = drain_timeout_s + CUT_GRACE_S  # uvicorn's own cancel: a backstop to the cut
    return Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace))


def _pools(config: ClusterConfig) -> str:
    if config.mode == "colocated":
        return f"{config.decode_workers} colocated worker(s)"
    return f"{config.prefill_workers} prefill + {config.decode_workers} decode worker(s), transport {config.transport}"


def _announce(host: str, port: int, model_id: str) -> None:
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"pdserve listening on {url}  (metrics {url}/metrics, health {url}/health)", flush=True)
    print(
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\'',
        flush=True,
    )
