"""`pdserve serve`: start (or join) Ray, start the worker pools, serve HTTP.

Shutdown on Ctrl-C / SIGTERM: uvicorn stops accepting and finishes, then the
workers are shut down and killed, and Ray is stopped if we started it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from cluster.config import ClusterConfig
from engine import envs

logger = logging.getLogger(__name__)

# CLI flag -> ClusterConfig field, for flags that override the YAML file.
CONFIG_FLAGS = {
    "model": "model",
    "dtype": "dtype",
    "mode": "mode",
    "prefill_workers": "prefill_workers",
    "decode_workers": "decode_workers",
    "transport": "transport",
    "address": "address",
    "router_policy": "router_policy",
    "threads_per_worker": "threads_per_worker",
    "gpus_per_worker": "gpus_per_worker",
    "block_size": "block_size",
    "prefill_kv_blocks": "prefill_kv_blocks",
    "decode_kv_blocks": "decode_kv_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_batch_tokens": "max_batch_tokens",
    "prefill_chunk_size": "prefill_chunk_size",
    "first_token_from": "first_token_from",
    "max_model_len": "max_model_len",
}


def add_serve_parser(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API over prefill and decode worker pools",
        description="Start (or join) a Ray cluster, start prefill and decode workers, and serve "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Flags override "
        "the YAML --config file; see docs/operations.md for every key.",
    )
    parser.add_argument("--config", help="YAML file with ClusterConfig keys")
    parser.add_argument("--model", help="'demo' (default) or a local HF model directory")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", choices=["disaggregated", "colocated"])
    parser.add_argument("--prefill-workers", type=int)
    parser.add_argument("--decode-workers", type=int)
    parser.add_argument("--transport", choices=["auto", "shm", "collective", "grpc", "local"])
    parser.add_argument("--address", help="Ray address to join (default: start a local Ray)")
    parser.add_argument("--router-policy", choices=["round_robin", "least_loaded", "power_of_two"])
    parser.add_argument("--threads-per-worker", type=int, help="torch threads per CPU worker")
    parser.add_argument("--gpus-per-worker", type=float)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--prefill-kv-blocks", type=int)
    parser.add_argument("--decode-kv-blocks", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-batch-tokens", type=int)
    parser.add_argument("--prefill-chunk-size", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--first-token-from", choices=["prefill", "decode"])
    parser.add_argument(
        "--api-key", default=None, help="require this bearer key (or PDSERVE_API_KEY)"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=256, help="admitted requests; past it, 429"
    )
    parser.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    overrides = {field: getattr(args, flag) for flag, field in CONFIG_FLAGS.items()}
    return ClusterConfig.load(args.config, overrides)


def run_serve(args: argparse.Namespace) -> int:
    from cluster.frontend import FrontendSettings

    config = config_from_args(args)
    settings = FrontendSettings(
        api_key=args.api_key or envs.api_key(), max_in_flight=args.max_in_flight
    )
    asyncio.run(_serve(config, settings, args.host, args.port))
    return 0


async def _serve(config: ClusterConfig, settings, host: str, port: int) -> None:
    from cluster.cluster import PDCluster
    from cluster.frontend import build_app

    cluster = PDCluster(config)
    logger.info("starting %s cluster (%s): %s", config.mode, cluster.model_id, _pools(config))
    await cluster.start()
    try:
        app = build_app(cluster, settings)
        server = _quiet_signals_server(app, host, port)
        app.router.on_startup.append(lambda: _announce(host, port, cluster.model_id))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)
        await server.serve()
    finally:
        logger.info("shutting down workers")
        await cluster.shutdown()


def _quiet_signals_server(app, host: str, port: int):
    """uvicorn re-raises SIGINT/SIGTERM after serving, which would kill this process
    before the workers and Ray are shut down; this server's signals only stop serving."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def request_exit(self) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))


def _pools(config: ClusterConfig) -> str:
    if config.mode == "colocated":
        return f"{config.decode_workers} colocated worker(s)"
    return f"{config.prefill_workers} prefill + {config.decode_workers} decode worker(s), transport {config.transport}"


def _announce(host: str, port: int, model_id: str) -> None:
    url = f"http://{host}:{port}"
    print(f"pdserve listening on {url}  (metrics {url}/metrics, health {url}/health)", flush=True)
    print(
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\'',
        flush=True,
    )
