"""The shipped deployment files still match the code: every config they carry loads into
`ClusterConfig` (unknown keys are an error there), and every `pdserve serve` command line
they run parses. A renamed key or flag breaks a cluster only at its next start, far from
the change that broke it; here it breaks the suite."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from cluster.cli.main import build_parser
from cluster.config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def shipped_configs() -> dict[str, str]:
    """Config name -> YAML text: the Ray launcher's file and each KubeRay ConfigMap's."""
    configs = {"ray/pdserve.yaml": (DEPLOY / "ray" / "pdserve.yaml").read_text()}
    for manifest in sorted((DEPLOY / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc and doc.get("kind") == "ConfigMap":
                for key, text in doc.get("data", {}).items():
                    if key.endswith(".yaml"):
                        configs[f"kuberay/{manifest.name}:{key}"] = text
    return configs


def serve_command_lines() -> dict[str, list[str]]:
    """Where a file runs `pdserve serve ...`, its flags: a manifest's shell line, the
    image's ENTRYPOINT, and the flags its `docker run` examples pass to that entrypoint."""
    found = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = re.search(r"^\s*(?:exec\s+)?pdserve serve\s+(.*)$", line)
            if match:
                found[f"{path.relative_to(DEPLOY)}:{number}"] = shlex.split(match.group(1))
    dockerfile = DEPLOY / "docker" / "Dockerfile"
    for number, line in enumerate(dockerfile.read_text().splitlines(), 1):
        entrypoint = re.match(r"ENTRYPOINT (\[.*\])", line)
        if entrypoint:
            command = json.loads(entrypoint.group(1))
            assert command[:2] == ["pdserve", "serve"], command
            found[f"docker/Dockerfile:{number}"] = command[2:]
        example = re.search(r"\spdserve:[\w.-]+\s+(--.*)$", line)  # a `docker run` example
        if example:
            found[f"docker/Dockerfile:{number}"] = [
                "--host",
                "0.0.0.0",
                *shlex.split(example.group(1)),
            ]
    return found


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_each_shipped_config_loads(name, tmp_path):
    path = tmp_path / "pdserve.yaml"
    path.write_text(shipped_configs()[name])
    config = ClusterConfig.load(str(path), {})
    assert config.prefill.workers >= 1 and config.decode.workers >= 1


def test_every_serve_command_line_in_the_manifests_parses():
    lines = serve_command_lines()
    assert lines, "no `pdserve serve` line found under deploy/"
    for where, flags in lines.items():
        args = build_parser().parse_args(["serve", *flags])
        assert args.command == "serve", where
