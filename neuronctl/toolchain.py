"""The build tools this host offers for C++ the torch backend compiles: where ninja is.

Low in the layers so that the kernel build (backends/torch/kernel.py) and doctor, which
reports it, find ninja the same way without either importing the other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def installed_ninja() -> str | None:
    """The ninja binary of the `ninja` Python package neuronctl depends on, if installed."""
    try:
        import ninja  # type: ignore[import-untyped]  # a path constant, no work at import
    except ImportError:
        return None
    binary = Path(ninja.BIN_DIR) / "ninja"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def ninja_path() -> str | None:
    """The ninja that builds neuronctl's kernels: PATH's, else the one neuronctl's `ninja`
    dependency installs beside this Python, which a PATH through a version manager's shims
    may not reach (backends/torch/kernel.py puts it on the build child's PATH)."""
    return shutil.which("ninja") or installed_ninja()
