"""Cluster layer: config, controller, router, HTTP frontend, metrics and the CLI."""

import importlib.metadata


def package_version() -> str:
    """pdserve's installed version (`pdserve --version`, the frontend's `/version`)."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"
