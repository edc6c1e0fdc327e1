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


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_each_shipped_gpu_config_sizes_its_pools_from_the_device(name, tmp_path):
    """A block count tuned to one GPU and model wastes a bigger GPU or overruns a smaller
    one: the shipped GPU configs leave `kv_blocks` unset, so each worker sizes its pool."""
    path = tmp_path / "pdserve.yaml"
    path.write_text(shipped_configs()[name])
    config = ClusterConfig.load(str(path), {})
    assert config.device == "cuda"
    for role in config.roles_in_use:
        assert config.kv_blocks(role) is None, role
        assert config.engine_config(role).sizes_kv_from_device


def test_the_tensor_parallel_example_fits_its_ray_cluster(tmp_path):
    """Each pool's pods hold its workers as the code places them: one unit of the pool's
    resource per worker whatever its tp, one GPU per rank, every rank of a worker in one
    pod (STRICT_PACK), and no GPU of a pod left idle."""
    path = tmp_path / "pdserve-tp.yaml"
    path.write_text(shipped_configs()["kuberay/pdserve-config.yaml:pdserve-tp.yaml"])
    # The cluster draws its token at start; worker specs carry it.
    config = ClusterConfig.load(str(path), {}).replace(transport={"token": "t" * 32})
    assert (config.prefill.workers, config.prefill.tp) == (4, 1)
    assert (config.decode.workers, config.decode.tp) == (1, 2)
    (cluster,) = yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster-tp.yaml").read_text())
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):
        group = groups[role]
        advertised = json.loads(json.loads(group["rayStartParams"]["resources"]))
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert limits == container["resources"]["requests"]
        gpus = int(limits["nvidia.com/gpu"])
        spec = config.worker_spec(f"{role}-0", role)
        (resource, share), tp = next(iter(spec.rank_resources.items())), spec.tp_size
        assert share * tp == pytest.approx(1.0, abs=1e-3)  # a pool unit per worker
        per_pod = min(
            int(advertised[resource] / (share * tp) + 1e-6), gpus // int(spec.rank_gpus * tp)
        )
        assert per_pod * group["replicas"] == config.pool(role).workers, role
        assert gpus == per_pod * tp * spec.rank_gpus, f"{role} pods hold GPUs no rank uses"


def test_every_serve_command_line_in_the_manifests_parses():
    lines = serve_command_lines()
    assert lines, "no `pdserve serve` line found under deploy/"
    for where, flags in lines.items():
        args = build_parser().parse_args(["serve", *flags])
        assert args.command == "serve", where


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, each with its continuation lines joined, comments
    dropped."""
    instructions, current = [], ""
    for line in (DEPLOY / "docker" / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += " " + line.strip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            instructions.append(current.strip())
            current = ""
    return instructions


def test_the_image_keeps_a_compiler_and_builds_the_kernels_it_installed():
    """The image runs the native kernels, not the torch fallback: it installs gcc and the
    C library headers, installs the package non-editably (the sources ship as package
    data: tests/test_native_install.py), and compiles them during the build as the user
    that serves, so a broken toolchain fails the build."""
    instructions = dockerfile_instructions()
    apt = next(text for text in instructions if "apt-get install" in text)
    assert {"gcc", "libc6-dev"} <= set(apt.split())
    (install,) = [
        i for i, text in enumerate(instructions) if "pip install /tmp/pdserve-src" in text
    ]
    assert " -e " not in instructions[install]
    user = instructions.index("USER pdserve")
    build = instructions.index("RUN python -m engine.native")
    (entrypoint,) = [i for i, text in enumerate(instructions) if text.startswith("ENTRYPOINT")]
    assert install < user < build < entrypoint
    assert (Path(__file__).resolve().parents[1] / "engine" / "native" / "__main__.py").is_file()


def test_one_recipe_builds_a_cpu_image_by_default_and_a_cuda_image_on_request():
    """VARIANT picks the base stage: the CPU image keeps python:3.11-slim and torch's CPU
    index; the CUDA image starts from an nvidia/cuda devel image (nvcc for FlashInfer's
    kernels), takes torch's CUDA wheel, installs a pinned FlashInfer, and fails its build
    where torch is a CPU build or triton or flashinfer does not import."""
    instructions = dockerfile_instructions()
    args = {  # the ARGs with a default (the stage re-declares VARIANT without one)
        text.split()[1].split("=")[0]: text.split("=", 1)[1]
        for text in instructions
        if text.startswith("ARG ") and "=" in text
    }
    assert "ARG VARIANT" in instructions  # in scope in the stage that branches on it
    assert args["VARIANT"] == "cpu"
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu[\d.]+", args["CUDA_BASE_IMAGE"])
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", args["FLASHINFER_VERSION"])
    froms = [text for text in instructions if text.startswith("FROM ")]
    assert froms == [
        "FROM ${BASE_IMAGE} AS base-cpu",
        "FROM ${CUDA_BASE_IMAGE} AS base-cuda",
        "FROM base-${VARIANT}",
    ]
    (torch_install,) = [text for text in instructions if '"torch==${TORCH_VERSION}"' in text]
    assert 'index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"' in torch_install
    assert 'index="${TORCH_INDEX_URL:-https://pypi.org/simple}"' in torch_install
    (cuda_extras,) = [text for text in instructions if "flashinfer-python==" in text]
    assert 'if [ "${VARIANT}" = cuda ]' in cuda_extras
    assert "import torch, triton, flashinfer; assert torch.version.cuda" in cuda_extras
    apt = next(text for text in instructions if "apt-get install" in text)
    assert "python3-dev" in apt  # Triton's launchers include Python.h
    assert instructions.index(torch_install) < instructions.index(cuda_extras)
    assert instructions.index(cuda_extras) < instructions.index("USER pdserve")
