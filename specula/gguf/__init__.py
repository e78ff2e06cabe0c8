"""GGUF files: reading blocks and vocabularies, the content-addressed conversion cache, and export of
targets and heads for llama.cpp."""
