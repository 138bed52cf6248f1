#!/usr/bin/env bash
# Quickstart, tests: install the package with its test tools, lint, run the suite.
source "$(dirname "$0")/_venv.sh"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
