"""GGUF files as targets: dequantized once into a Hugging Face directory kept in a content-addressed cache.

`cached_hf_dir(gguf_file, root)` returns ``root/<sha256 of the file>/``, a normal
Hugging Face directory (model.safetensors in float32, config.json, tokenizer
files with the chat template, generation_config.json) plus ``specula-gguf.json``,
a manifest naming the source hash and every file with its size. The first call
converts through `transformers`' own GGUF loader (`from_pretrained(dir,
gguf_file=name)`, dequantizing every tensor); it writes into a temporary
sibling directory and renames it into place, so an interrupted conversion never
leaves an entry that looks complete. Later calls check the manifest (files
present, sizes equal, safetensors header readable) and use the entry as it is;
a damaged entry is deleted and rebuilt.

Before converting, `check_gguf_file` reads the file's header itself (a few
milliseconds, unlike the `gguf` package's reader, which parses the whole
vocabulary) so that a file that is not GGUF or is truncated is refused with a
clear reason before any work starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.runtime.transformers_logging import quiet_transformers

MANIFEST = "specula-gguf.json"
DIGESTS = "digests"  # beside the entries: the source files' digests (`keep_digest`), so that a start need not hash
MANIFEST_VERSION = 1
STALE_TMP_SECONDS = 3600  # a temporary directory this old belongs to a conversion that was killed

_hash_memo: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """Hex SHA-256 of a file's content, remembered per (path, size, mtime) for the life of the process and, with
    ``memo_dir``, read from a digest `keep_digest` kept there by an earlier process: hashing SmolLM2's 98 MB GGUF
    is ~0.06 s of every start. A kept digest is used only while the file's size, mtime, ctime and inode are those it
    was computed for (a write changes the ctime, which no program can set back), so an edited or replaced file is
    hashed again."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _hash_memo:
        kept = None
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            if memo_dir is not None:
                memo = json.loads(_memo_file(memo_dir, key[0]).read_text())
                kept = memo["sha256"] if memo["stat"] == _identity(stat) and len(memo["sha256"]) == 64 else None
        if kept is None:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
            kept = digest.hexdigest()
        _hash_memo[key] = kept
    return _hash_memo[key]


def keep_digest(path: Path, memo_dir: Path, sha256: str) -> None:
    """Keep ``path``'s digest in ``memo_dir`` for later processes (`file_sha256`); a failure costs only hashing."""
    resolved = str(path.resolve())
    memo = {"path": resolved, "stat": _identity(path.stat()), "sha256": sha256}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(_memo_file(memo_dir, resolved).read_text()) == memo:
            return  # kept already: a start writes nothing
    with contextlib.suppress(OSError, SpeculaError):
        memo_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(_memo_file(memo_dir, resolved), memo)


def _memo_file(memo_dir: Path, resolved: str) -> Path:
    return memo_dir / f"{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.json"


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


# ---------------------------------------------------------------- header check

# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Truncated(Exception):
    pass


class _HeaderReader:
    """Little-endian cursor over a memory-mapped GGUF file that raises _Truncated past its end."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise _Truncated
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise _Truncated
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos])

    def skip_string(self) -> None:
        n = self.take("Q")
        self.pos += n

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("I"), self.take("Q")
            if item == 8:
                for _ in range(count):
                    self.skip_string()
            elif item in _SCALARS:
                self.pos += count * struct.calcsize("<" + _SCALARS[item])
            else:
                raise ValueError(f"unknown metadata array type {item}")
            if self.pos > len(self.data):
                raise _Truncated
            return None
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def check_gguf_file(path: Path) -> str:
    """The file's ``general.architecture``, after checking it is a complete GGUF file; else SpeculaError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def refuse(reason: str) -> SpeculaError:
        return SpeculaError(f"cannot read GGUF file {path}: {reason}")

    size = path.stat().st_size
    if size < 24:
        raise refuse(f"it has only {size} bytes, too short for a GGUF header")
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise refuse("it is not a GGUF file (it does not start with the GGUF magic bytes)")
        reader = _HeaderReader(data)
        reader.pos = 4
        try:
            version = reader.take("I")
            if version < 2:
                raise refuse(f"GGUF version {version} is not supported (2 or later is)")
            tensors, entries = reader.take("Q"), reader.take("Q")
            metadata = {}
            for _ in range(entries):
                key = reader.string().decode("utf-8", "replace")
                metadata[key] = reader.value(reader.take("I"))
            alignment = metadata.get("general.alignment") or 32
            end = 0
            for _ in range(tensors):
                name = reader.string().decode("utf-8", "replace")
                dims = [reader.take("Q") for _ in range(reader.take("I"))]
                kind, offset = reader.take("I"), reader.take("Q")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise refuse(f"tensor {name} has a tensor type ({kind}) the gguf package does not know") from None
                count = 1
                for dim in dims:
                    count *= dim
                end = max(end, offset + count // block * block_bytes)
            data_start = -(-reader.pos // alignment) * alignment
        except _Truncated:
            raise refuse(f"it is truncated inside its header ({size} bytes)") from None
        except (ValueError, struct.error) as err:
            raise refuse(f"its header is malformed ({err})") from None
    if data_start + end > size:
        raise refuse(f"it is truncated: {size} bytes, but its tensors end at byte {data_start + end}")
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, bytes):
        raise refuse("its header names no general.architecture")
    return architecture.decode("utf-8", "replace")


# ---------------------------------------------------------------- cache entries


def entry_is_valid(entry: Path, sha256: str) -> bool:
    """Whether ``entry`` is a complete conversion of the file with this hash (manifest, sizes, safetensors)."""
    from safetensors import safe_open

    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION or manifest.get("source_sha256") != sha256 or not files:
            return False
        for name, size in files.items():
            if (entry / name).stat().st_size != size:
                return False
        json.loads((entry / "config.json").read_text(encoding="utf-8"))
        for name in files:
            if name.endswith(".safetensors"):
                with safe_open(str(entry / name), "pt") as weights:
                    if not list(weights.keys()):
                        return False
    except Exception:  # missing files, bad JSON, a damaged safetensors header (SafetensorError): rebuild
        return False
    return True


def cached_hf_dir(gguf_file: Path, root: Path) -> Path:
    """The Hugging Face directory converted from ``gguf_file`` under ``root``, converting it if needed."""
    gguf_file = Path(gguf_file)
    try:
        sha256 = file_sha256(gguf_file, root / DIGESTS)
    except OSError as err:
        raise SpeculaError(f"cannot read GGUF file {gguf_file}: {err.strerror or err}") from err
    entry = root / sha256
    if entry_is_valid(entry, sha256):
        keep_digest(gguf_file, root / DIGESTS, sha256)
        return entry
    check_gguf_file(gguf_file)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(root, sha256)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha256}.tmp-", dir=root))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the entry is an ordinary cache directory
    except OSError as err:
        raise SpeculaError(f"cannot write to the cache {root}: {err.strerror or err} "
                           "(set SPECULA_CACHE_DIR to a writable directory)") from err
    try:
        with _Progress(gguf_file.name) as progress:
            convert_gguf(gguf_file, tmp, progress)
            _write_manifest(tmp, gguf_file, sha256)
            if entry.exists():
                if entry_is_valid(entry, sha256):  # another process finished first
                    return entry
                shutil.rmtree(entry)  # damaged: replace it
            os.rename(tmp, entry)
            keep_digest(gguf_file, root / DIGESTS, sha256)
            progress.done(entry)
    except OSError as err:
        raise SpeculaError(f"cannot write the converted {gguf_file.name} to {root}: {err.strerror or err}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
    return entry


def convert_gguf(gguf_file: Path, out: Path, progress=None) -> None:
    """Dequantize ``gguf_file`` with `transformers` and save model and tokenizer into ``out`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {}
    try:  # newer transformers can keep GGUF blocks packed; a saved directory needs them unpacked
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    stage = progress.stage if progress is not None else (lambda text: None)
    with quiet_transformers(), _legacy_gguf_bar_off():
        stage("dequantizing the weights")
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                         dtype=torch.float32, local_files_only=True, **options)
            stage("reading the tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                      local_files_only=True)
        except Exception as err:  # the GGUF loader fails in many ways (ValueError, KeyError, NotImplementedError...)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise SpeculaError(f"cannot read GGUF file {gguf_file}: {reason}") from err
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # the weights are plain tensors now; saving refuses while this is attached
            quantizer.remove_quantization_config(model)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        stage("writing safetensors")
        model.save_pretrained(out)  # an OSError here (disk full) is reported by the caller as a write failure
        tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _legacy_gguf_bar_off() -> Iterator[None]:
    """Older transformers' GGUF loader draws a plain tqdm bar that ignores `disable_progress_bar`; our progress
    line replaces it."""
    try:
        from transformers import modeling_gguf_pytorch_utils as legacy_loader
    except ImportError:
        legacy_loader = None
    legacy_bar = getattr(legacy_loader, "tqdm", None)
    if legacy_bar is not None:
        legacy_loader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if legacy_bar is not None:
            legacy_loader.tqdm = legacy_bar


def _write_manifest(out: Path, gguf_file: Path, sha256: str) -> None:
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"version": MANIFEST_VERSION, "source_sha256": sha256, "source_name": gguf_file.name,
                "source_size": gguf_file.stat().st_size, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _remove_stale_tmp(root: Path, sha256: str) -> None:
    for leftover in root.glob(f".{sha256}.tmp-*"):
        try:
            if time.time() - leftover.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


class _Progress:
    """One status line on stderr while a conversion runs.

    On a terminal the line is rewritten per stage and erased if the conversion
    fails (so bad input still ends as one error line); elsewhere only the final
    "converted" line is printed.
    """

    def __init__(self, name: str):
        self.name = name
        self.live = sys.stderr.isatty()
        self.started = time.perf_counter()

    def __enter__(self) -> _Progress:
        return self

    def stage(self, text: str) -> None:
        if self.live:
            sys.stderr.write(f"\r\033[Kspecula: converting {self.name} to a Hugging Face directory "
                             f"(first use only): {text}...")
            sys.stderr.flush()

    def done(self, entry: Path) -> None:
        self._clear()
        print(f"specula: converted {self.name} in {time.perf_counter() - self.started:.0f} s into {entry} "
              "(later loads read it from there)", file=sys.stderr)

    def _clear(self) -> None:
        if self.live:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.live = False

    def __exit__(self, *exc) -> None:
        self._clear()
