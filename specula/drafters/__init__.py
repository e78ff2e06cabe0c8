"""One drafter per method behind the `Drafter` protocol; `specula.methods` says which method uses which."""

from specula.drafters.base import Drafter

__all__ = ["Drafter"]
