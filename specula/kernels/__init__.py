"""Compiled kernels Specula builds on the user's machine (C++ sources beside their Python loaders)."""
