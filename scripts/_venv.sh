# Sourced by the quickstart scripts: a project virtual environment in .venv, created once, with
# the CPU build of torch (pinned: an unpinned torch pulls several GB of CUDA wheels) and the
# newest megatron-core that installs here, before the package itself.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
"${PIP[@]}" torch==2.13.0 megatron-core==0.16.1
