"""Compiled kernels Specula builds on the user's machine (C++ sources beside their Python loaders)."""

from __future__ import annotations

import os
import shutil


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on PATH ($CXX first, as torch's extension builder and Inductor use it)."""
    return any(shutil.which(name) for name in (os.environ.get("CXX"), "g++", "clang++", "c++") if name)
