"""Data-parallel training: the same trainer under torchrun gives the single-process loss curve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORIES

SCRIPT = Path(__file__).parent / "scripts" / "train_tiny_eagle.py"


def losses(command: list[str], out: Path) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([*command, str(SCRIPT), str(STORIES), str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_process_data_parallel_matches_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch and must sit beside the interpreter"
    single = losses([sys.executable], tmp_path / "one")
    parallel = losses([torchrun, "--nproc_per_node", "2", "--master_port", "29517"], tmp_path / "two")
    assert len(single) == len(parallel) == 8
    assert parallel == pytest.approx(single, rel=1e-4)
