"""Cluster layer, in subpackages by what they hold:

- `cluster.flow`: the request data plane (`PDCluster`, request flow, router, disaggregation)
- `cluster.control`: the control plane (controller, local head, core plan, metrics)
- `cluster.api`: the OpenAI-compatible HTTP layer (frontend, protocol, tools)
- `cluster.cli`: the `pdserve` command line, above everything (it imports `bench` too)

At this root: what all of them share, the config (`config`, `config_flags`), the
per-request timeline (`timeline`) and the package version.
"""

import importlib.metadata


def package_version() -> str:
    """pdserve's installed version (`pdserve --version`, the frontend's `/version`)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"
