"""Every `pdserve serve` flag maps to one config field and back.

For each leaf field of `ClusterConfig` (its sections' fields included), `FrontendSettings`
and `RequestLimits`, a value other than the default is written on the command line with
the field's flag, parsed by the real parser, and must come back as that field, with
that value, and nothing else. Every flag the parser takes is one of those, or one of
the command's own (`--config`, `--host`, `--port`, `--drain-timeout-s`), so no flag is
copied by hand beside the dataclasses.
"""

from __future__ import annotations

import argparse
from typing import Literal, get_args, get_origin

import pytest

from cluster.api.frontend_settings import FrontendSettings
from cluster.api.request_limits import RequestLimits
from cluster.cli.main import build_parser
from cluster.cli.serve import UNFLAGGED
from cluster.config import ClusterConfig
from cluster.config_flags import ConfigFlag, config_flags, config_overrides

SERVE_OWN_FLAGS = {"-h", "--help", "--config", "--host", "--port", "--drain-timeout-s"}
CLASSES = {
    ClusterConfig: UNFLAGGED,
    FrontendSettings: frozenset({"limits"}),
    RequestLimits: frozenset(),
}
PARSER = build_parser()
CASES = [(cls, flag) for cls, skip in CLASSES.items() for flag in config_flags(cls, skip)]


def other_value(flag: ConfigFlag):
    """A value of the field's type that is not its default."""
    hint, default = flag.hint, flag.default
    choices = flag.metadata.get("choices") or (
        get_args(hint) if get_origin(hint) is Literal else None
    )
    if choices:
        return next(c for c in choices if c != default)
    if hint is bool:
        return not default
    if hint is int:
        return (default or 0) + 3
    if hint is float:
        return (default or 0.0) + 1.5
    if hint is str:
        return f"value-of-{flag.path}"
    if get_origin(hint) is tuple:
        return ("first", "second")
    raise AssertionError(f"no test value for {flag.path}: {hint!r}")


def command_line(flag: ConfigFlag, value) -> list[str]:
    if isinstance(value, bool):
        return [flag.flag if value else flag.flag.replace("--", "--no-", 1)]
    if isinstance(value, tuple):
        return [flag.flag, *value]
    return [flag.flag, str(value)]


def nested(path: str, value) -> dict:
    *sections, name = path.split(".")
    tree = {name: value}
    for section in reversed(sections):
        tree = {section: tree}
    return tree


@pytest.mark.parametrize(("cls", "flag"), CASES, ids=[f"{c.__name__}:{f.flag}" for c, f in CASES])
def test_each_field_round_trips_through_its_flag(cls, flag):
    value = other_value(flag)
    args = PARSER.parse_args(["serve", *command_line(flag, value)])
    given = {c.__name__: config_overrides(args, c, skip) for c, skip in CLASSES.items()}
    assert given == {c.__name__: {} for c in CLASSES} | {cls.__name__: nested(flag.path, value)}


def test_every_serve_flag_is_a_field_or_the_commands_own():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    taken = {opt for action in serve._actions for opt in action.option_strings}
    derived = {flag.flag for _, flag in CASES}
    negated = {flag.flag.replace("--", "--no-", 1) for _, flag in CASES if flag.hint is bool}
    assert taken == derived | negated | SERVE_OWN_FLAGS
    assert len(derived) == len(CASES), "two fields share a flag"


def test_every_cluster_field_has_a_flag_but_the_secret():
    """The section fields are walked, not skipped: the flags cover every leaf key."""
    paths = {flag.path for flag in config_flags(ClusterConfig)}
    flagged = {flag.path for flag in config_flags(ClusterConfig, UNFLAGGED)}
    assert paths - flagged == {"transport.token"}
    assert {"prefill.workers", "decode.kv_blocks", "transport.name"} <= flagged
    assert "transport.faults.mode" in flagged


def test_section_flags_lay_over_the_yaml_section(tmp_path):
    """A flag changes its key only: the file's other keys of that section stay."""
    path = tmp_path / "pdserve.yaml"
    path.write_text("decode:\n  workers: 2\n  kv_blocks: 300\ntransport:\n  name: grpc\n")
    args = build_parser().parse_args(
        ["serve", "--decode-kv-blocks", "400", "--transport-lease-ttl-s", "12"]
    )
    config = ClusterConfig.load(path, config_overrides(args, ClusterConfig, UNFLAGGED))
    assert (config.decode.workers, config.decode.kv_blocks) == (2, 400)
    assert (config.transport.name, config.transport.lease_ttl_s) == ("grpc", 12.0)
    assert config.prefill == ClusterConfig().prefill
    options = config.replace(transport={"token": "t"}).kv_transport_options()
    assert (options.lease_ttl_s, options.timeout_s) == (12.0, 30.0)
