# Sourced by the quickstart scripts: a project virtual environment in .venv, created once.
# Nothing here installs torch; the runtime issue will add `pip install torch==2.13.0` (the
# CPU build) before anything that depends on it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
