"""Cluster layer: config, controller, router, HTTP frontend, metrics and the CLI."""
