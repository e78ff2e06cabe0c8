"""`specula check`: greedy identity with vanilla, divergences explained, and a distribution test with its
power shown. ``specula.certify.check`` is the public entry (also ``specula.check``)."""

from specula.certify.check import check, check_greedy, check_sampling

__all__ = ["check", "check_greedy", "check_sampling"]
