"""Writing outputs without ever destroying anything: atomic files and output directories we own.

Atomic writes. Every file specula writes goes to a temporary sibling first, is
flushed to disk (fsync) and then renamed over its final name, so an interrupted
run or a full disk never leaves a truncated file where a whole one was:
`atomic_write` (any writer), `atomic_write_text`, `atomic_write_bytes`,
`atomic_write_json`; `atomic_replace_dir` does the same for a whole directory
(a training checkpoint). A failed write is one SpeculaError naming the file.

Output directories. `prepare_output_dir(path, kind, resume)` is called before any
expensive work. ``--out`` must be a new or empty directory, or one the same
command wrote before, recognised by the marker file ``.specula-output.json``
(``{"kind": "train eagle", ...}``) it leaves there. A directory holding anything
specula did not write there (a model or head with config.json / *.safetensors,
or any other file) is refused, as is an earlier run's checkpoint unless
``resume`` says to continue it; ``--out`` that is a file, lies under a file or
cannot be written is refused too — all before anything is written. Commands whose outputs predate the
marker, or that resume from their own results file (bench's ``results.json``, train data's ``run.json``), name
that file as ``own_file``: a directory holding it is theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from specula.errors import SpeculaError

MARKER = ".specula-output.json"
MARKER_VERSION = 1


def _reason(err: OSError) -> str:
    return err.strerror or str(err) or type(err).__name__


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    tmp = None
    try:
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(handle)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; outputs are meant to be shared
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as err:  # a full disk, a read-only or vanished directory
        raise SpeculaError(f"cannot write {path}: {_reason(err)}") from err
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj, indent: int | None = 1) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_replace_dir(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Build a directory with ``fill(staging)`` in a sibling, then swap it in for ``path`` (old one removed).

    Between the two renames the old directory sits at ``.<name>.old``; at no moment is a
    half-written directory at ``path``.
    """
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp")
    old = path.with_name(f".{path.name}.old")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        fill(staging)
        for file in staging.rglob("*"):
            if file.is_file():
                with open(file, "rb+") as written:
                    os.fsync(written.fileno())
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(staging, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        raise SpeculaError(f"cannot write {path}: {_reason(err)}") from err


# ------------------------------------------------------------------------------------ output directories


def read_marker(directory: Path) -> dict | None:
    """The marker specula left in ``directory``, or None (absent or not one of ours)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("kind"), str) else None


def _holds_model(directory: Path) -> bool:
    return (directory / "config.json").exists() or any(directory.glob("*.safetensors"))


def _check_owner(out: Path, kind: str, resume: bool, own_file: str | None, flag: str) -> dict | None:
    """Refuse an existing directory this command may not write into; returns its marker if it has one."""
    marker = read_marker(out)
    others = [entry for entry in out.iterdir() if entry.name != MARKER]
    if marker is None:
        legacy_run = resume and (out / "checkpoint" / "trainer_state.pt").is_file()  # written before markers
        own_output = own_file is not None and (out / own_file).is_file()
        if others and not (legacy_run or own_output):
            names = ", ".join(sorted(entry.name for entry in others)[:3])
            what = "a model or draft head" if _holds_model(out) else f"files it did not write ({names})"
            raise SpeculaError(f"{flag} {out} already holds {what}; `specula {kind}` writes only into a new or "
                               "empty directory or its own earlier output")
        return None
    if marker["kind"] != kind:
        raise SpeculaError(f"{flag} {out} holds the output of `specula {marker['kind']}`, not of `specula {kind}`; "
                           "choose another directory")
    if not resume and (out / "checkpoint").exists():
        raise SpeculaError(f"{flag} {out} holds an earlier run of `specula {kind}`: add --resume to continue it, "
                           "or choose a new directory")
    return marker


def _probe_writable(directory: Path, out: Path, flag: str = "--out") -> None:
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".specula-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise SpeculaError(f"{flag} {out} cannot be written: {directory}: {_reason(err)}") from err


def prepare_output_dir(path: str | Path, kind: str, resume: bool = False, create: bool = True,
                       own_file: str | None = None, flag: str = "--out") -> Path:
    """Check that ``kind`` (e.g. "train eagle", "convert") may write into ``path``, then create and mark it.

    Raises SpeculaError, having written nothing, when ``path`` is a file, lies under a file,
    cannot be written, or is a directory this command did not write (see the module docstring).
    ``create=False`` only checks, so that a command can fail fast and claim the directory once its
    other inputs have proved usable (nothing is left behind by a run that stops at bad input).
    ``own_file`` names a file that marks the directory as this command's own (see the module docstring);
    ``flag`` is the option that named ``path``, for the messages.
    """
    out = Path(path)
    existing = _first_existing(out)
    if existing is not None and not existing.is_dir():
        if existing == out:
            raise SpeculaError(f"{flag} {out} is a file, not a directory")
        raise SpeculaError(f"{flag} {out} lies under {existing}, which is a file")
    marker = _check_owner(out, kind, resume, own_file, flag) if existing == out else None
    _probe_writable(existing if existing is not None else Path.cwd(), out, flag)
    if not create:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpeculaError(f"{flag} {out} cannot be created: {_reason(err)}") from err
    if marker is None:
        atomic_write_json(out / MARKER, {"kind": kind, "version": MARKER_VERSION})
    return out


def _first_existing(path: Path) -> Path | None:
    return next((p for p in (path, *path.parents) if p.exists()), None)


def check_cache_dir(path: str | Path, flag: str) -> Path:
    """Check, writing nothing, that ``path`` is a directory specula can keep files in (it may exist, with files).

    A file, a path under a file, or a directory that cannot be written is one SpeculaError naming ``flag``,
    raised before any work whose results would go there.
    """
    directory = Path(path)
    existing = _first_existing(directory)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == directory else f"lies under {existing}, which is a file"
        raise SpeculaError(f"{flag} {directory} {where}, not a directory")
    _probe_writable(existing if existing is not None else Path.cwd(), directory, flag)
    return directory


def check_output_file(path: str | Path, flag: str, replace: bool) -> Path:
    """Check, writing nothing, that a file can be written at ``path`` (replacing one only if ``replace``)."""
    file = Path(path)
    if file.is_dir():
        raise SpeculaError(f"{flag} {file} is a directory; name the file to write")
    if file.exists() and not replace:
        raise SpeculaError(f"{flag} {file} exists; add --force to replace it")
    existing = _first_existing(file.parent)
    if existing is not None and not existing.is_dir():
        raise SpeculaError(f"{flag} {file} lies under {existing}, which is a file")
    if existing != file.parent:
        raise SpeculaError(f"{flag} {file}: directory {file.parent} does not exist")
    _probe_writable(file.parent, file, flag)
    return file


def check_replaceable_file(path: str | Path, flag: str, what: str, is_ours: Callable[[Path], bool]) -> Path:
    """`check_output_file` for a command that rewrites its own earlier output: an existing file is replaced only
    if ``is_ours`` recognises it as ``what`` (e.g. "a hardware profile"); anything else there is refused."""
    file = check_output_file(path, flag, replace=True)
    if file.exists() and not is_ours(file):
        raise SpeculaError(f"{flag} {file} exists and is not {what}, so it is not replaced; choose another file "
                           "or move it away")
    return file


def atomic_write_gguf(path: str | Path, writer) -> None:
    """Write a filled `gguf.GGUFWriter` (header, metadata, tensors) to ``path`` atomically, then close it."""

    def write(tmp: str) -> None:
        writer.write_header_to_file(path=Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
