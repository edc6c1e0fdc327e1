"""How the HTTP frontend serves: keys, limits, TLS, disclosure. `pdserve serve` derives a
flag from every field (cluster/config_flags.py) and builds one `FrontendSettings`, which
`frontend.build_app` and the HTTP server (cluster/cli/serve.py) read."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.api.request_limits import RequestLimits
from cluster.api.tool_parsers import TOOL_PARSERS
from engine import envs


@dataclass(frozen=True)
class FrontendSettings:
    """How the HTTP frontend serves; `pdserve serve` has a flag for every field."""

    api_key: str | None = None
    """When set (or PDSERVE_API_KEY), every /v1 call and /tokenize need `Authorization:
    Bearer <api_key>`."""
    admin_api_key: str | None = None
    """When set, /admin/* needs `Authorization: Bearer <admin_api_key>`. While `api_key`
    is set and this is not, /admin/* is refused: a tenant's key never opens the
    operators' endpoints. With neither set (a local run) both are open. Also read from
    PDSERVE_ADMIN_API_KEY."""
    max_body_bytes: int = 4 << 20
    """Largest request body read; past it, 413, whatever the body's framing."""
    read_timeout_s: float = 30.0
    """Bound on receiving a request's headers, and again on receiving its body."""
    max_in_flight: int = 256
    """Requests admitted at once (each choice of `n` counts, and so does a request whose
    body is still being read); past it, 429 with Retry-After."""
    limit_concurrency: int | None = None
    """Connections the HTTP server holds at once; past it, new ones get a 503. None:
    `max_in_flight` + 64 (room for health checks and scrapes)."""
    ssl_keyfile: str | None = None
    """Serve HTTPS with this private key (PEM); needs `ssl_certfile`."""
    ssl_certfile: str | None = None
    """Serve HTTPS with this certificate chain (PEM); needs `ssl_keyfile`."""
    enable_prompt_tokens_details: bool = False
    """Disclose prefix-cache hits: usage's `prompt_tokens_details.cached_tokens`, and the
    cache fields and route scores of `pdserve_timings` (vLLM's flag of the same name).
    Off by default: they tell one tenant whether another sent the same prompt prefix."""
    retry_after_s: int = 1
    """The Retry-After of a 429 or 503, in seconds."""
    tool_call_parser: str = field(default="hermes", metadata={"choices": ("none", *TOOL_PARSERS)})
    """How answers to chat requests with tool_choice `auto` are read for tool calls:
    `hermes` (<tool_call>{...}</tool_call> JSON blocks) or `none` (plain content)."""
    served_model_names: tuple[str, ...] = field(
        default=(), metadata={"flag": "--served-model-name", "metavar": "NAME"}
    )
    """The names requests may give as `model`, the first one listed by /v1/models and
    echoed when a request names none. Empty: the model's own name and its --model
    argument."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """What one request may ask for (cluster/api/request_limits.py, flags of their own)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_in_flight <= 0 or self.read_timeout_s <= 0:
            raise ValueError("max_body_bytes, max_in_flight and read_timeout_s must be positive")
        if self.limit_concurrency is not None and self.limit_concurrency <= 0:
            raise ValueError("limit_concurrency must be positive")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both or neither")
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("served_model_names must be non-empty strings")
        if self.tool_call_parser not in ("none", *TOOL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of none, {', '.join(TOOL_PARSERS)}; "
                f"got {self.tool_call_parser!r}"
            )

    @property
    def connection_limit(self) -> int:
        return self.limit_concurrency or self.max_in_flight + 64

    @classmethod
    def from_env(cls, **given) -> FrontendSettings:
        """`given` (the serve flags given), the keys filled from the environment where
        no flag gave them."""
        given.setdefault("api_key", envs.api_key())
        given.setdefault("admin_api_key", envs.admin_api_key())
        return cls(**given)
