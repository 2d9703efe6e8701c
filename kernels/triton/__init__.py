"""Triton GPU kernels. Each module pairs a kernel with the torch reference it is tested against.

On CUDA they run compiled; on CPU only tests run them, under Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py when no GPU is present). Engine code reaches
them through `kernels/__init__.py`'s dispatch, never directly.
"""
