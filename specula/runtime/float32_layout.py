"""Whether `Float32Linear`'s matmul layout is faster than `F.linear` on this CPU: measured once, then cached.

`Float32Linear` multiplies as ``W @ x.T`` (a one-row input as two columns) where `F.linear` computes
``x @ W.T``. Which one reads a large weight faster for decoding's few rows depends on the CPU and the BLAS,
and by a factor of two to three either way. Measured with torch 2.13.0 (MKL), 2 threads, SmolLM2-135M's
49,152 x 576 float32 LM head, ``F.linear`` → ``Float32Linear``:

- AMD EPYC (Zen 3, AVX2): 1 row 9.1 → 5.1 ms, 4 rows 21.3 → 5.6 ms, 16 rows 24.2 → 13.9 ms;
- Intel Xeon (AVX-512, AMX): 1 row 2.65 → 7.13 ms, 4 rows 4.61 → 7.12 ms, 16 rows 5.82 → 10.02 ms.

So no fixed choice is right. `columns_layout_pays()` times both layouts on float32 weights far larger than a
core's cache (as a decoding step streams its weights), for 1 and 4 rows, and keeps the answer in
``float32-layout.json`` in Specula's cache, keyed by CPU model, vector ISA, torch version and thread count, so every
later load on the machine makes the same choice without measuring (a model's float32 rounding then does not
depend on a timing taken in that process). ``SPECULA_FLOAT32_LAYOUT=columns`` or ``=rows`` decides without
measuring. Either layout computes the same products and sums in float32, possibly in another order.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.runtime.model_source import cache_dir

ENVIRONMENT_VARIABLE = "SPECULA_FLOAT32_LAYOUT"
CACHE_FILE = "float32-layout.json"
# 64 MiB of float32 weights in four matrices: beyond any one core's L2 and most of an L3 slice, as a step's
# 500 MiB of float32 weights are; about 0.3 s to measure.
PROBE_SHAPE = (4, 4096, 1024)
PROBE_ROWS = (1, 4)
PROBE_REPEATS = 7
# Columns must win by this much (summed over PROBE_ROWS) to be chosen: a tie keeps torch's own layout.
MARGIN = 0.9


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows of it."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        return cpu


def machine_key() -> str:
    """The CPU model and vector ISA, torch version and thread count: what the choice depends on."""
    cpu = cpu_name()
    # A VM may name its CPU only generically ("Intel(R) Xeon(R) Processor"): the vector ISA torch picked helps
    # tell such machines apart.
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{cpu} | {isa} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def columns_layout_pays() -> bool:
    """True when `Float32Linear`'s layout is the faster one on this CPU (``$SPECULA_FLOAT32_LAYOUT``, else the
    cached measurement, else a new one, cached)."""
    forced = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if forced:
        if forced not in ("columns", "rows"):
            raise SpeculaError(f"{ENVIRONMENT_VARIABLE} must be 'columns' or 'rows', not {forced!r}")
        return forced == "columns"
    return _measured_choice(machine_key(), cache_dir() / CACHE_FILE)


@functools.cache
def _measured_choice(key: str, path: Path) -> bool:
    try:
        choices = json.loads(path.read_text())
        if not isinstance(choices, dict):
            choices = {}
    except (OSError, ValueError):
        choices = {}  # none yet, or unreadable: measured again and rewritten whole
    entry = choices.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("columns"), bool):
        return entry["columns"]
    rows_ms, columns_ms = measure()
    entry = {"columns": sum(columns_ms) < MARGIN * sum(rows_ms), "rows": list(PROBE_ROWS),
             "f_linear_ms": rows_ms, "columns_ms": columns_ms}
    print(f"specula: timed this CPU's float32 matmul layouts once (1 and 4 rows: F.linear {rows_ms} ms, "
          f"columns {columns_ms} ms); using {'columns' if entry['columns'] else 'F.linear'}, recorded in {path}",
          file=sys.stderr, flush=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**choices, key: entry})
    except OSError:
        pass  # a read-only cache: the choice holds for this process, measured again next time
    return entry["columns"]


def measure() -> tuple[list[float], list[float]]:
    """Median milliseconds of one pass over the probe weights, per row count in PROBE_ROWS: (F.linear, columns)."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.rand(PROBE_SHAPE[1:], generator=generator) for _ in range(PROBE_SHAPE[0])]

    def rows_pass(x: torch.Tensor) -> None:
        for weight in weights:
            F.linear(x, weight)

    def columns_pass(x: torch.Tensor) -> None:
        columns = (x.repeat(2, 1) if x.shape[0] == 1 else x).t()
        for weight in weights:
            (weight @ columns).t().contiguous()

    rows_ms, columns_ms = [], []
    with torch.no_grad():
        for count in PROBE_ROWS:
            x = torch.rand(count, PROBE_SHAPE[2], generator=generator)
            times: dict[str, list[float]] = {"rows": [], "columns": []}
            for _ in range(PROBE_REPEATS + 1):  # interleaved; the first of each is a warm-up
                for name, one_pass in (("rows", rows_pass), ("columns", columns_pass)):
                    start = time.perf_counter()
                    one_pass(x)
                    times[name].append(time.perf_counter() - start)
            rows_ms.append(round(statistics.median(times["rows"][1:]) * 1e3, 3))
            columns_ms.append(round(statistics.median(times["columns"][1:]) * 1e3, 3))
    return rows_ms, columns_ms
