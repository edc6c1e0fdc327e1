"""How much one request may ask for: the bounds the frontend checks while it parses a body.

Each bound caps work the request would otherwise make the engine do for every token
(a bias entry, a stop id, a stop string scanned, a choice decoded), so one client
cannot slow every stream beside its own. `pdserve serve` takes a flag per field
(`add_limit_flags`); the frontend hands the limits to `parse_body`, which answers a
request over any of them with a 400 naming the parameter and the limit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from cluster.config_flags import add_config_flags, config_overrides


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds, read by `cluster.api.openai_params.request_of`."""

    max_logit_bias_entries: int = 300
    """Most token ids one request's logit_bias may map (OpenAI's own limit)."""
    max_stop_token_ids: int = 64
    """Most distinct stop_token_ids one request may send (duplicates count once)."""
    max_stop_strings: int = 16
    """Most stop strings one request may send."""
    max_stop_string_chars: int = 512
    """Longest stop string, in characters."""
    max_choices: int = 64
    """Most choices one request may fan out to: batched prompts x n."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = RequestLimits()
"""The limits of a server started without limit flags (and of callers that pass none)."""


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """`pdserve serve`'s flags, one per `RequestLimits` field (`--max-choices`, ...)."""
    group = parser.add_argument_group(
        "request limits", "bounds on what one request may ask for; past one, a 400"
    )
    add_config_flags(group, RequestLimits)


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The limits the flags give (defaults for those left out); a bad value exits with
    the reason, before anything starts."""
    try:
        return RequestLimits(**config_overrides(args, RequestLimits))
    except ValueError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
