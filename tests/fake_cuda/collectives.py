"""Collectives on the fake device: checked, agreed across the real group, not run.

A collective whose tensors are fake `cuda` tensors cannot reach gloo or NCCL (there is no data).
Instead each call is checked (every tensor a fake cuda tensor on the current device; output and
input sizes consistent with the op) and recorded, and the ranks agree on it for real: a small
int64 signature (op, output and input element counts, dtype) goes through the group's own
all_gather (gloo on CPU), and every rank must have issued the same op with the same sizes — the
rule that keeps NCCL from hanging or corrupting data. Split sizes given as host lists are fine
(they are baked into a captured step); computing them needs a device read, which the dispatch
mode reports. Collectives on real host tensors run as usual.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from .record import Record, call_site

_OPS = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
        "reduce_scatter_single", "all_reduce", "broadcast")
_DTYPES = {dtype: i for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                                               torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn))}


def _fake(*tensors) -> bool:
    return any(isinstance(t, FakeTensor) for t in tensors)


class FakeCollectives:
    def __init__(self, record: Record):
        self.record = record
        self.calls: list[tuple[str, tuple[int, ...], str, bool]] = []  # (op, sizes, where, captured)

    def _check(self, op: str, tensors: list[torch.Tensor]) -> None:
        current = torch.device("cuda", torch.cuda.current_device())
        for t in tensors:
            if not isinstance(t, FakeTensor) or t.device != current:
                raise self.record.fault("collective", f"{op}: a {t.device} tensor among the fake cuda tensors on "
                                        f"{current}")

    def _agree(self, op: str, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        """Every rank issued this op with these sizes (a real gloo all_gather of the signature)."""
        world = dist.get_world_size(group)
        mine = torch.tensor([_OPS.index(op), out.numel(), inp.numel(), _DTYPES.get(out.dtype, -1)], dtype=torch.long)
        everyone = torch.zeros(world * 4, dtype=torch.long)
        dist.all_gather_into_tensor(everyone, mine, group=group)
        rows = everyone.view(world, 4).tolist()
        if any(row != rows[0] for row in rows):
            raise self.record.fault("collective", f"{op}: the ranks issued different collectives or sizes {rows}")
        self.calls.append((op, (out.numel(), inp.numel()), call_site(), bool(self.record.capturing)))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        self._check("all_to_all_single", [output, input])
        if output_split_sizes is None and input_split_sizes is None and output.numel() != input.numel():
            raise self.record.fault("collective", f"all_to_all_single: equal splits need equal sizes, got "
                                    f"{tuple(output.shape)} and {tuple(input.shape)}")
        self._agree("all_to_all_single", output, input, group)
        return _Done() if async_op else None

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        self._check("all_gather_into_tensor", [output, input])
        if output.numel() != input.numel() * dist.get_world_size(group):
            raise self.record.fault("collective", "all_gather: the output is not world_size inputs")
        self._agree("all_gather_into_tensor", output, input, group)
        return _Done() if async_op else None

    def reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):
        self._check("reduce_scatter_tensor", [output, input])
        if input.numel() != output.numel() * dist.get_world_size(group):
            raise self.record.fault("collective", "reduce_scatter: the input is not world_size outputs")
        self._agree("reduce_scatter_tensor", output, input, group)
        return _Done() if async_op else None

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._check("all_reduce", [tensor])
        self._agree("all_reduce", tensor, tensor, group)
        return _Done() if async_op else None

    def broadcast(self, tensor, src=None, group=None, async_op=False, **_):
        self._check("broadcast", [tensor])
        self._agree("broadcast", tensor, tensor, group)
        return _Done() if async_op else None


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def fake_collectives(record: Record):
    """Route collectives on fake tensors to FakeCollectives (torch.distributed's functions, and
    the aliases engine/distributed/all2all.py takes of them at import)."""
    from engine.distributed import all2all

    fakes = FakeCollectives(record)
    patched = []

    def wrap(real, fake_fn):
        def call(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            return fake_fn(*args, **kwargs) if _fake(*tensors) else real(*args, **kwargs)
        return call

    for name in _OPS:
        real = getattr(dist, name, None)
        if real is None:
            continue
        fake_name = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
        patched.append((dist, name, real))
        setattr(dist, name, wrap(real, getattr(fakes, fake_name.get(name, name))))
    for alias, fake_name in (("_all_gather", "all_gather_into_tensor"), ("_reduce_scatter", "reduce_scatter_tensor")):
        real = getattr(all2all, alias)
        patched.append((all2all, alias, real))
        setattr(all2all, alias, wrap(real, getattr(fakes, fake_name)))
    try:
        yield fakes
    finally:
        for module, name, real in patched:
            setattr(module, name, real)
