"""`specula serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `Speculator`.

`create_app` builds the app, `engine` holds the decoding worker behind the `Engine`
interface, `runner` runs it under uvicorn with a graceful shutdown.

The names below are imported when first used: `specula serve`'s options are read before any of them is needed,
and importing FastAPI and the app for that alone cost ~17 MiB and ~0.25 s.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"ServeSettings": "app", "create_app": "app", "BatchedEngine": "engine", "Engine": "engine",
            "GenerationRequest": "engine", "RequestStream": "engine", "running_server": "runner", "serve": "runner",
            "bind_socket": "runner"}
__all__ = sorted(_EXPORTS)

# A request body not whole within this many seconds is a 408: a slow or stalled client holds no slot forever
# (`ServeSettings.body_timeout_s`, `specula serve --body-timeout`).
BODY_TIMEOUT_S = 30.0


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
