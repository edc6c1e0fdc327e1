#!/bin/sh
# Regenerate the committed gRPC stubs (same as `python -m proto.generate`).
set -e
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m proto.generate "$@"
