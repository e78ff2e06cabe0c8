"""The options of `specula bench`'s llama.cpp rows (``llamacpp``, ``llamacpp-draft``), checked before anything runs.

Kept apart from `specula.bench.llamacpp` so that `specula.bench.config` can check a config's
tables without importing the runner.
"""

from __future__ import annotations

import math

from specula.errors import SpeculaError

SPEC_TYPES = ("draft-simple", "draft-eagle3")
DRAFT_SAMPLING = ("greedy", "probabilistic")
# option -> (kind, llama-server flag)
DRAFT_OPTIONS = {
    "spec_type": ("spec_type", "--spec-type"),
    "draft_max": ("count", "--spec-draft-n-max"),
    "draft_min": ("count0", "--spec-draft-n-min"),
    "draft_p_min": ("probability", "--spec-draft-p-min"),
    "draft_sampling": ("draft_sampling", "--spec-draft-sampling"),
}
LLAMACPP_METHODS = {"llamacpp": set(), "llamacpp-draft": set(DRAFT_OPTIONS)}


def check_llamacpp_options(label: str, method: str, draft: str | None, options: dict) -> dict:
    """The options of a llama.cpp row, checked; a SpeculaError names the first bad one."""
    allowed = LLAMACPP_METHODS[method]
    unknown = set(options) - allowed
    if unknown:
        raise SpeculaError(f"method {label} ({method}) does not take option(s) {', '.join(sorted(unknown))}; "
                           f"it takes {', '.join(sorted(allowed)) or 'none'}")
    if method == "llamacpp-draft" and not draft:
        raise SpeculaError(f"method {label} (llamacpp-draft) needs a draft: a GGUF file, a Llama model directory "
                           f"or (spec_type draft-eagle3) an EAGLE-3 head; set draft in [methods.{label}] or "
                           f"--option {label}.draft=PATH")
    if method == "llamacpp" and draft:
        raise SpeculaError(f"method {label} (llamacpp) takes no draft; use llamacpp-draft for speculative decoding")
    for key, value in options.items():
        kind = DRAFT_OPTIONS[key][0]
        ok = {
            "spec_type": value in SPEC_TYPES,
            "draft_sampling": value in DRAFT_SAMPLING,
            "count": isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            "count0": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
            "probability": isinstance(value, (int, float)) and not isinstance(value, bool)
                           and math.isfinite(value) and 0 <= value <= 1,
        }[kind]
        if not ok:
            expected = {"spec_type": f"one of {', '.join(SPEC_TYPES)}", "draft_sampling": " or ".join(DRAFT_SAMPLING),
                        "count": "a whole number >= 1", "count0": "a whole number >= 0",
                        "probability": "a number in [0, 1]"}[kind]
            raise SpeculaError(f"method {label}: {key} must be {expected}, got {value!r}")
    return dict(options)
