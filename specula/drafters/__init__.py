"""One drafter class per method, built by name. Later methods register here without touching the loop."""

from __future__ import annotations

from typing import Any

from specula.drafters.base import Drafter
from specula.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from specula.drafters.prompt_lookup import PromptLookupDrafter
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.target import Target

METHODS = ("vanilla", "sps", "pld", "eagle", "eagle2", "eagle3", "medusa", "ada")


def build_drafter(method: str, target: Target, draft: str | None = None, dtype: str = "auto",
                  **options: Any) -> Drafter:
    """Make the drafter for ``method``; ``draft`` is the draft model or head directory where one is needed."""
    if method == "vanilla":
        return VanillaDrafter()
    if method == "pld":
        return PromptLookupDrafter(**options)
    if method == "sps":
        if not draft:
            raise SpeculaError("method sps needs --draft DIR, a small model with the target's tokenizer")
        draft_model = Target.load(draft, dtype=dtype, device=target.device, max_length=target.max_length,
                                  role="draft")
        check_same_vocabulary(target, draft_model)
        return DraftModelDrafter(draft_model, **options)
    if method in ("eagle", "eagle2"):
        from specula.drafters.eagle import EagleDrafter
        from specula.heads.eagle_head import EagleHead

        if not draft:
            raise SpeculaError(f"method {method} needs --draft HEAD_DIR, a trained EAGLE head for this target")
        head = EagleHead.from_pretrained(draft, dtype=target.dtype, device=target.device)
        return EagleDrafter(target, head, dynamic=method == "eagle2", **options)
    if method == "eagle3":
        from specula.drafters.eagle import EAGLE3_BUDGETS, EagleDrafter
        from specula.heads.eagle3_head import Eagle3Head

        if not draft:
            raise SpeculaError("method eagle3 needs --draft HEAD_DIR, a trained EAGLE-3 head for this target")
        head = Eagle3Head.from_pretrained(draft, dtype=target.dtype, device=target.device,
                                          num_target_layers=target.config.num_hidden_layers)
        return EagleDrafter(target, head, dynamic=True, name="eagle3", budgets=EAGLE3_BUDGETS, **options)
    if method == "medusa":
        from specula.drafters.medusa import build_medusa_drafter

        if not draft:
            raise SpeculaError("method medusa needs --draft HEAD_DIR, trained Medusa heads for this target")
        return build_medusa_drafter(target, draft, **options)
    if method == "ada":
        from specula.drafters.ada import build_ada_drafter

        return build_ada_drafter(target, draft, **options)
    raise SpeculaError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")


__all__ = ["Drafter", "METHODS", "build_drafter"]
