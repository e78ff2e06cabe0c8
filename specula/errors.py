"""The one exception type users see for bad input; the CLI turns it into a one-line message and exit 2."""


class SpeculaError(ValueError):
    """Bad input or an unusable model/checkpoint, with a message meant for the user."""
