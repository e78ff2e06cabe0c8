"""Hardware profiles written by `specula calibrate` and read as defaults by `bench` (and `generate`).

A profile is one JSON file per target model name, by default
``~/.cache/specula/runtime/profile-<target name>.json`` (``$SPECULA_CACHE_DIR`` or
``$XDG_CACHE_HOME/specula`` move the directory). It records the machine it was
measured on and, per method, what calibration measured and the drafter options
it recommends:

    {"target": "pycoder-25m", "device": "cpu", "dtype": "bfloat16", "threads": 2,
     "target_step_s": 0.004, "verify_cost_s": {"1": 0.004, "2": 0.0045, ...},
     "methods": {"sps": {"alpha": 0.71, "c": 0.18, ..., "defaults": {"num_tokens": 4}}, ...},
     "auto_weights": {"choice": "int4", "method": "sps", "formats": {"float32": {"step_s": 0.078, ...}, ...}}}

``auto_weights`` is what ``--weights auto`` means for this target on this device type
(`specula.runtime.weights.resolve_weights`): calibrate's measured choice of weight format.

`profile_defaults(profile, method, device)` returns the recommended drafter
options of one method (empty when the profile is for another device type), to
be used under anything the user sets explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.runtime.model_source import cache_dir

PROFILE_VERSION = 1


def profile_dir() -> Path:
    return cache_dir()


def profile_path(target_name: str) -> Path:
    return profile_dir() / f"profile-{target_name}.json"


def load_profile(target_name: str, path: str | Path | None = None) -> dict | None:
    """The profile of ``target_name`` (a model directory's name, as `Target.name`), or None if there is none.

    A profile that cannot be read raises SpeculaError naming the file, rather
    than being silently ignored: it would change defaults without saying so.
    """
    file = Path(path) if path is not None else profile_path(target_name)
    if not file.is_file():
        if path is not None:
            raise SpeculaError(f"profile not found: {file}")
        return None
    try:
        profile = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"cannot read hardware profile {file}: {err} (delete it or run specula calibrate)") from err
    problem = _malformed(profile)
    if problem:
        raise SpeculaError(f"hardware profile {file} is malformed: {problem} (delete it or run specula calibrate)")
    profile.setdefault("methods", {})
    profile["path"] = str(file)
    return profile


def _malformed(profile) -> str:
    """What is wrong with the shape of a decoded profile ("" if nothing): every level read must be of its type."""
    if not isinstance(profile, dict):
        return "it is not a JSON object"
    for key in ("target", "device", "dtype"):
        if key in profile and not isinstance(profile[key], str):
            return f"'{key}' is not a string"
    if not isinstance(profile.get("auto_weights", {}), dict):
        return "'auto_weights' is not an object"
    methods = profile.get("methods", {})
    if not isinstance(methods, dict):
        return "'methods' is not an object"
    for method, entry in methods.items():
        if not isinstance(entry, dict):
            return f"methods.{method} is not an object"
        if not isinstance(entry.get("defaults") or {}, dict):
            return f"methods.{method}.defaults is not an object"
    return ""


def measured_on(profile: dict | None, device: str = "cpu") -> bool:
    """Whether ``profile`` exists and was measured on ``device``'s type (cpu, cuda, ...): only then it applies."""
    return bool(profile) and str(profile.get("device", "cpu")).split(":")[0] == str(device).split(":")[0]


def profile_defaults(profile: dict | None, method: str, device: str = "cpu") -> dict:
    """Drafter options the profile recommends for ``method`` on ``device`` ({} if none apply)."""
    if not measured_on(profile, device):
        return {}
    entry = profile["methods"].get(method) or {}
    defaults = entry.get("defaults") or {}
    return dict(defaults) if isinstance(defaults, dict) else {}


def all_defaults(profile: dict | None, device: str = "cpu") -> dict[str, dict]:
    if not profile:
        return {}
    return {method: profile_defaults(profile, method, device) for method in profile["methods"]}


def save_profile(profile: dict, path: str | Path) -> Path:
    """Write ``profile`` (merging the methods of an existing profile for the same target) atomically."""
    file = Path(path)
    merged = dict(profile)
    if file.is_file():
        try:
            old = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        # Measurements in another weight format are of another model: not merged (older profiles were float32).
        same_machine = isinstance(old, dict) and all(
            old.get(k) == profile.get(k) for k in ("target", "device", "dtype", "threads")) and (
            old.get("weights", "float32") == profile.get("weights", "float32"))
        if same_machine and isinstance(old.get("methods"), dict):
            merged["methods"] = {**old["methods"], **profile.get("methods", {})}
        # The choice of format is made across formats: a later calibration in the chosen one keeps it.
        same_device = isinstance(old, dict) and all(
            old.get(k) == profile.get(k) for k in ("target", "device", "threads"))
        if same_device and "auto_weights" not in merged and isinstance(old.get("auto_weights"), dict):
            merged["auto_weights"] = old["auto_weights"]
    merged.pop("path", None)
    merged["version"] = PROFILE_VERSION
    file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(file, merged, indent=2)
    return file
