"""Compiled kernels Specula builds on the user's machine (C++ sources beside their Python loaders).

Each kernel is a torch extension built once per machine and torch version into Specula's cache
(``~/.cache/specula/kernels``, `specula.runtime.model_source.cache_dir`) with the C++ compiler and ninja, then
loaded as ``torch.ops.specula.*`` ops; `scripts/install.sh` builds them so a first run does not wait. A later
start loads the built library directly when its recipe (flags) matches, without torch's extension builder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_bytes
from specula.runtime.model_source import cache_dir

LDFLAGS = ["-fopenmp"]


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on PATH ($CXX first, as torch's extension builder and Inductor use it)."""
    return any(shutil.which(name) for name in (os.environ.get("CXX"), "g++", "clang++", "c++") if name)


def ninja() -> str | None:
    """The ninja executable: the `ninja` package's (in the venv, which need not be on PATH), else PATH's."""
    try:
        import ninja as package

        candidate = Path(package.BIN_DIR) / "ninja"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("ninja")


def avx2_build_problem(kernel: str, device: torch.device | str = "cpu") -> str | None:
    """Why an AVX2 CPU kernel cannot run on ``device`` here (before trying to build it), or None."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the {kernel} kernel runs on CPUs only, not on '{device}'"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the {kernel} kernel needs an x86 CPU with AVX2 (this CPU: {capability})"
    if not has_cpp_compiler():
        return f"building the {kernel} kernel needs a C++ compiler (install g++)"
    if ninja() is None:
        return f"building the {kernel} kernel needs ninja (pip install ninja)"
    return None


def build_directory(kernel: str) -> Path:
    """Where a kernel's build lives: per torch version (an extension is tied to the torch it was built for) and
    per source content, so two installs of different Specula versions sharing one cache never rebuild over each
    other (they did: each load saw the other's source and recompiled, for seconds every time)."""
    digest = hashlib.sha256(Path(__file__).with_name(f"{kernel}.cpp").read_bytes()).hexdigest()[:12]
    return cache_dir() / "kernels" / f"{kernel}-torch{torch.__version__.replace('+', '-')}-{digest}"


def build(kernel: str, source: Path, flags: list[str]) -> None:
    """Build ``source`` into ``specula_<kernel>.so`` (unless this machine has it) and load its ops; SpeculaError
    saying why where it cannot be built (`avx2_build_problem`) or the build fails."""
    reason = avx2_build_problem(kernel)
    if reason:
        raise SpeculaError(reason)
    directory = build_directory(kernel)
    directory.mkdir(parents=True, exist_ok=True)
    # Its real path: the source copy's path is written into the build file, and a cache reached through a
    # symlink (the test suite links the machine's kernels into its own cache) must not look like another build.
    directory = directory.resolve()
    name = f"specula_{kernel}"
    library, recipe_file = directory / f"{name}.so", directory / "recipe.json"
    recipe = json.dumps({"cflags": flags, "ldflags": LDFLAGS})
    if library.exists() and recipe_file.exists() and recipe_file.read_text(encoding="utf-8") == recipe:
        # Built here before from this source (the directory's key), torch and flags (the recipe): load it without
        # importing torch's extension builder and running ninja to confirm it (0.1-0.2 s of every start).
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # a damaged library: built again below
            library.unlink(missing_ok=True)
    if not library.exists():  # a rebuild after a source change is silent, like torch's
        print(f"specula: building the {kernel} kernel once for this machine (about 30 s) in {directory}",
              file=sys.stderr, flush=True)
    # torch runs "ninja" from PATH; a venv's own ninja is not on it unless the venv is activated.
    ninja_dir = str(Path(ninja()).parent)
    if ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load as load_extension

    # Built from a copy inside the build directory: ninja rebuilds when a source's path changes, and two
    # checkouts of the same version (a repository and its installed wheel) would otherwise do that in turn.
    copy, text = directory / source.name, source.read_bytes()
    if not copy.exists() or copy.read_bytes() != text:
        atomic_write_bytes(copy, text)
    try:
        load_extension(name=name, sources=[str(copy)], extra_cflags=flags, extra_ldflags=LDFLAGS,
                       build_directory=str(directory), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        log = directory / "build.log"  # torch's first line is the command; the compiler's words come later
        log.write_text(str(err), encoding="utf-8")
        raise SpeculaError(f"could not build the {kernel} kernel in {directory} "
                           f"(the compiler's output: {log})") from err
    atomic_write_bytes(recipe_file, recipe.encode())


def kernel_report(kernel: str, load: Callable[[], object], without: str) -> str:
    """Build ``kernel`` now through its ``load`` if this machine has no build, and say what happened in one line
    (`scripts/install.sh` prints it); ``without``: what runs where it cannot be built."""
    reason = avx2_build_problem(kernel)
    if reason is None:
        try:
            load()
            return f"{kernel} kernel ready in {build_directory(kernel)}"
        except SpeculaError as err:
            reason = str(err)
    return f"{kernel} kernel unavailable on this machine ({without}): {reason}"
