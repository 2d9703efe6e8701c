"""ringserve's engine: one device's serving of any registered architecture.

The core is here (engine.py, scheduler, block manager, KV pools and layout, model runner,
sampler, prefix cache, static decode backends, worker); `models/` says what an architecture
provides and maps config.json to one; `v4/` (DeepSeek-V4) and `v41/` (DeepSeek-V4.1) are the
architectures; `distributed/` spans worker processes (DP/EP, all-to-all, EPLB); `kv_transfer/`
moves KV between engines (PD disaggregation).

No HTTP or JSON lives here; `server/` drives this package and `kernels/` supplies its ops.
"""
