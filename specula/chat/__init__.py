"""Chat: a model's chat template, its end-of-turn stop, and `specula chat`'s conversation loop."""
