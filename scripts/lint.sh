#!/usr/bin/env bash
# The style and type gates CI runs (and .pre-commit-config.yaml runs before each commit):
# ruff lint, ruff format check, mypy on the whole package as Python 3.11 reads it (pyproject.toml
# [tool.mypy]: duplex_actors and its pytest plugin).
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
.venv/bin/ruff check . || status=$?
.venv/bin/ruff format --check . || status=$?
.venv/bin/mypy || status=$?
exit $status
