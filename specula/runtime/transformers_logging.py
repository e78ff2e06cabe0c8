"""`transformers` kept quiet while Specula loads or converts a model through it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """`transformers` at error level and without its per-tensor progress bars (noise for a local load), restored
    after. It imports `transformers`, so only the loads that use it enter it: a warm load from the converted cache
    does not (`specula.runtime.loading`)."""
    from transformers import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
