#!/usr/bin/env bash
# Quickstart, tests: install the package with its test tools, lint, run the suite.
# MZB_MEGATRON_CORE=0.19.2 runs it on that megatron-core instead, in its own virtual environment on
# Python 3.12 (.venv-mcore-0.19.2, about 5 GB; see scripts/_venv.sh). The exit status is pytest's.
# Two pytest workers (MZB_TEST_WORKERS; 0 runs in this process): a gloo case keeps about one core busy,
# its ranks mostly wait on each other, so a second worker fills the other core. More workers each
# start their own gloo pools (a few GB); give more only with the memory for them.
source "$(dirname "$0")/_venv.sh"
# Megatron-LM's pure-Python dependencies too: the tests run Megatron-LM's training loop from the shared
# checkouts (../shared/megatron-lm) and, on megatron-core >= 0.17, from the wheel's own megatron.training.
EXTRAS="test,megatron-lm"
"$VENV_PY" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$VENV_PY" -m pytest -q -n "${MZB_TEST_WORKERS:-2}" --dist worksteal "$@"
