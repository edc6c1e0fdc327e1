"""The docs name only flags and config keys the code has: a renamed flag breaks this test,
not a reader's copy-paste.

Every `pdserve ...` command line in README.md and docs/*.md (fenced blocks and inline
code, with backslash continuations joined) is resolved through the real argument
parser to its subcommand, and each `--flag` on it must be one that subcommand takes.
Every key in the config table of docs/operations.md must be a `ClusterConfig` field
(a section's key written with a dot: `prefill.workers`, `transport.faults.mode`), and
every field must be in the table. Every source file the docs point at
(`cluster/api/frontend.py`) must exist, so a moved module leaves no old path behind.
"""

from __future__ import annotations

import argparse
import functools
import re
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from cluster.cli.main import build_parser
from cluster.config import ClusterConfig
from cluster.config_flags import section_type

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w@+-])--[a-z][a-z0-9-]*")
SERVE_FLAG = re.compile(r"(?<=[@+])--[a-z][a-z0-9-]*")
"""A `pdserve serve` flag carried by a compare-servers server spec (`name@--x=1+--y=2`)."""
COMMAND_END = re.compile(r"\s(?:\||&&|;|>|#)\s")
SOURCE_PATH = re.compile(
    r"(?<![\w/.-])((?:engine|worker|kv_transfer|prefill_worker|decode_worker|proto|cluster"
    r"|bench|tests|deploy)/[\w/.-]*\.(?:py|proto|yaml|json|sh))\b"
)
"""A path into one of the project's folders, as the docs name a module or a config file."""


def command_lines(text: str) -> list[str]:
    """Code lines (fenced or inline) that run `pdserve`, continuations joined."""
    lines, block, fenced = [], [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            block.append(line)
            if not line.rstrip().endswith("\\"):
                lines.append(" ".join(part.rstrip("\\ ") for part in block))
                block = []
        else:
            lines += re.findall(r"`([^`]*pdserve [^`]*)`", line)
    return [line for line in lines if re.search(r"(^|[\s/])pdserve\s", line)]


def subcommand(parser: argparse.ArgumentParser, words: list[str]):
    """The parser a command line's words lead to, and the words it consumed."""
    path = []
    for word in words:
        choices = next(
            (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
            None,
        )
        if not choices or word not in choices:
            break
        parser = choices[word]
        path.append(word)
    return parser, path


@functools.cache
def pdserve_parser() -> argparse.ArgumentParser:
    """Built once: every documented command is checked against the same parser."""
    return build_parser()


def accepted_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in command_lines(doc.read_text()):
            command = COMMAND_END.split(line)[0]
            found.append((doc.name, command[command.index("pdserve") :]))
    return found


@pytest.mark.parametrize(("doc", "command"), documented_commands())
def test_every_documented_flag_exists(doc, command):
    words = command.split()[1:]
    parser, path = subcommand(pdserve_parser(), [w for w in words if not w.startswith("-")])
    top_level = accepted_flags(pdserve_parser())
    unknown = [
        flag
        for flag in FLAG.findall(command)
        if flag not in accepted_flags(parser) and flag not in top_level
    ]
    assert not unknown, f"{doc}: `pdserve {' '.join(path)}` has no {unknown} ({command})"
    serve, _ = subcommand(pdserve_parser(), ["serve"])
    unserved = [flag for flag in SERVE_FLAG.findall(command) if flag not in accepted_flags(serve)]
    assert not unserved, f"{doc}: `pdserve serve` has no {unserved} ({command})"


def config_keys(cls=ClusterConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config, a section's with its dotted path."""
    keys = []
    for f in fields(cls):
        section = section_type(cls, f.name)
        if section is None:
            keys.append(prefix + f.name)
        else:
            keys += config_keys(section, f"{prefix}{f.name}.")
    return keys


def yaml_keys(data: dict, prefix: str = "") -> list[str]:
    """The dotted paths of a YAML example's keys, down to its leaves."""
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys += yaml_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_the_config_table_lists_exactly_the_config_keys():
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| key | default | flag | meaning |") :]
    table = table[: table.index("\n\n")]
    keys = re.findall(r"^\| `([a-z_.]+)` \|", table, flags=re.M)
    assert sorted(keys) == sorted(config_keys())


def test_config_keys_named_in_yaml_examples_exist():
    text = (ROOT / "docs" / "operations.md").read_text()
    valid = set(config_keys())
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        for key in yaml_keys(yaml.safe_load(block) or {}):
            assert key in valid, f"docs/operations.md yaml example uses unknown key {key!r}"


def test_every_source_path_in_the_docs_exists():
    missing = [
        f"{doc.name}: {path}"
        for doc in DOCS
        for path in SOURCE_PATH.findall(doc.read_text())
        if not (ROOT / path).exists()
    ]
    assert missing == []
