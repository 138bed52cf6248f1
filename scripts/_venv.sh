# Sourced by the quickstart scripts: a project virtual environment, created once, with torch
# (pinned: an unpinned torch pulls whatever CUDA wheels are newest) and megatron-core installed
# before the package itself.
#
# MZB_MEGATRON_CORE picks the megatron-core version (default 0.16.1, the newest for Python 3.11,
# in .venv with the CPU build of torch). Any other version gets its own folder,
# .venv-mcore-<version>, on Python 3.12 (megatron-core >= 0.17 needs it; torch for 3.12 is the
# regular CUDA wheel, about 5 GB, which runs on the CPU). After sourcing: VENV, VENV_PY.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MZB_MEGATRON_CORE="${MZB_MEGATRON_CORE:-0.16.1}"
MZB_TORCH="${MZB_TORCH:-2.13.0}"

# The first Python 3.12 found: pyenv's versions, then python3.12 on PATH (a pyenv shim may
# name a version that is not selected, so every candidate is run, not just looked up).
find_python312() {
  local candidates=() root
  if command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root 2>/dev/null || true)"
    [ -n "$root" ] && candidates+=("$root"/versions/3.12*/bin/python3.12)
  fi
  candidates+=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12)
  candidates+=("$(command -v python3.12 || true)" /usr/bin/python3.12 /usr/local/bin/python3.12)
  local c
  for c in "${candidates[@]}"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

if [ "$MZB_MEGATRON_CORE" = "0.16.1" ]; then
  VENV=.venv
  BASE_PY=python3
else
  VENV=".venv-mcore-$MZB_MEGATRON_CORE"
  if ! BASE_PY="$(find_python312)"; then
    echo "MZB_MEGATRON_CORE=$MZB_MEGATRON_CORE needs Python 3.12 (megatron-core >= 0.17 requires it): none found" \
      "(looked in \$(pyenv root)/versions/3.12*/bin and for python3.12 on PATH)." \
      "Install it (e.g. 'pyenv install 3.12') or leave MZB_MEGATRON_CORE unset for 0.16.1 on Python 3.11." >&2
    exit 2
  fi
fi
VENV_PY="$VENV/bin/python"
if [ ! -x "$VENV_PY" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
PIP=("$VENV_PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
"${PIP[@]}" "torch==$MZB_TORCH" "megatron-core==$MZB_MEGATRON_CORE"
