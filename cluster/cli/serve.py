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

from cluster.api.frontend_settings import FrontendSettings
from cluster.api.request_limits import add_limit_flags, limits_from_args
from cluster.config import ClusterConfig
from cluster.config_flags import add_config_flags, config_overrides

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
        "and /metrics. Every ClusterConfig key is a flag (a section's keys as "
        "--{section}-{key}: --prefill-workers, --transport-chunk-bytes); flags override the "
        "YAML --config file (see docs/operations.md).",
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
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="on SIGTERM or Ctrl-C: refuse new connections, let requests in flight finish for "
        "up to this many seconds, then cut the rest and stop (a second signal stops at once; "
        f"default: {DRAIN_TIMEOUT_S:g}, under Kubernetes' 30 s grace period)",
    )
    add_config_flags(parser, FrontendSettings, skip={"limits"})
    add_config_flags(parser, ClusterConfig, skip=UNFLAGGED)
    add_limit_flags(parser)
    parser.set_defaults(func=run_serve)


UNFLAGGED = frozenset({"transport.token"})
"""Config keys with no flag: a secret on a command line is in every process listing."""


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig.load(args.config, config_overrides(args, ClusterConfig, UNFLAGGED))


def run_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        settings = FrontendSettings.from_env(
            **config_overrides(args, FrontendSettings), limits=limits_from_args(args)
        )
    except ValueError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
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
    from cluster.api.frontend import build_app
    from cluster.flow.cluster import PDCluster

    port = listener.getsockname()[1]
    cluster = PDCluster(config)
    logger.info("starting %s cluster (%s): %s", config.mode, cluster.model_id, _pools(config))
    for line in cluster.rank_capacity():
        print(line, flush=True)
    await cluster.start()
    try:
        for line in cluster.sized_pool_capacity():  # pools sized from the device: known only now
            print(line, flush=True)
        app = build_app(cluster, settings)
        server = _draining_server(app, settings, drain_timeout_s)
        name = app.state.handler.model_name
        scheme = "https" if settings.ssl_certfile else "http"
        app.router.on_startup.append(lambda: _announce(scheme, host, port, name))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)
        await server.serve(sockets=[listener])
    finally:
        logger.info("shutting down workers")
        await cluster.shutdown()


def _draining_server(app, settings: FrontendSettings, drain_timeout_s: float):
    """uvicorn's server, told to stop by our signal handlers rather than its own (it
    re-raises SIGINT/SIGTERM after serving, which would kill this process before the
    workers and Ray are shut down). A first signal starts the frontend's drain and
    uvicorn's graceful shutdown (no new connections; it waits for the open ones); a
    second one cuts what runs at once."""
    import uvicorn

    from cluster.api.http_protocol import bounded_protocol

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
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=grace,
        http=bounded_protocol(settings.connection_limit, settings.read_timeout_s),
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
    )
    return Server(config)


def _pools(config: ClusterConfig) -> str:
    if config.mode == "colocated":
        return f"{config.decode.workers} colocated worker(s) of tp={config.decode.tp}"
    return (
        f"{config.prefill.workers} prefill (tp={config.prefill.tp}) + {config.decode.workers} "
        f"decode worker(s) (tp={config.decode.tp}), transport {config.transport.name}"
    )


def _announce(scheme: str, host: str, port: int, model_id: str) -> None:
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    print(f"pdserve listening on {url}  (metrics {url}/metrics, health {url}/health)", flush=True)
    print(
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\'',
        flush=True,
    )
