"""The Megatron-LM checkouts tests run against: MEGATRON_LM_PATH, else the project's shared one for this Python.

``../shared/megatron-lm`` beside the project holds real, unmodified checkouts (core_v0.16.1 imports on
Python 3.11, core_v0.19.0 needs 3.12): CI's two environments each run one, with megatron-core also
installed, as a user has them. Megatron-LM compiles its dataset helpers into the tree and Python writes
``__pycache__`` there, and CI's copy of shared/ is read-only: tests run a writable copy.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "megatron-lm"
SHARED_CHECKOUT = SHARED / ("core_v0.19.0" if sys.version_info >= (3, 12) else "core_v0.16.1")


def given() -> str | None:
    """The checkout MEGATRON_LM_PATH names (used as it is), or None."""
    return os.environ.get("MEGATRON_LM_PATH") or None


def available() -> bool:
    return given() is not None or SHARED_CHECKOUT.is_dir()


def skip_reason() -> str:
    return f"no Megatron-LM checkout: set MEGATRON_LM_PATH (or have {SHARED_CHECKOUT})"


def checkout(folder: Path) -> Path:
    """MEGATRON_LM_PATH as given; else a writable copy of the shared checkout in ``folder`` (made once)."""
    if given() is not None:
        return Path(given())
    copy = folder / SHARED_CHECKOUT.name
    if not copy.is_dir():
        shutil.copytree(SHARED_CHECKOUT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        for path in (copy, *copy.rglob("*")):
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return copy
