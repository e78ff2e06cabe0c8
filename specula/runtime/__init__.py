"""The target at run time: loading a causal LM, its forward over token trees, KV caches, compiled steps,
packed batching and weight formats (the kernels' C++ lives in `specula.kernels`)."""
