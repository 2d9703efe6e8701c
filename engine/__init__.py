"""ringserve's engine: the DeepSeek-V4 model, its per-sequence state, weights and generation.

No HTTP or JSON lives here; `server/` drives this package and `kernels/` supplies its ops.
"""
