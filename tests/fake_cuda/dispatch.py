"""The dispatch mode that makes `cuda` tensors fake and keeps CPU tensors real.

Every aten op passes through `FakeCudaMode.__torch_dispatch__`:
- an op with no fake tensor and no `cuda` device runs for real (the host side of the engine —
  schedulers' tensors, pinned mirrors, numpy views — works as on a GPU machine);
- an op on `cuda` runs under torch's FakeTensorMode (shapes, dtypes and devices propagate, no
  data exists), after the checks a GPU would make that meta kernels do not:
  * strict dtypes for GEMM-like ops (`bf16 @ fp32` is an error on CUDA, not on meta) and index
    dtypes for indexing ops;
  * no CPU tensor with elements mixed into a CUDA op (a 0-dim CPU tensor is a scalar, allowed
    as on CUDA);
  * ops whose CUDA implementation reads the device from the host (`.item()`, `.tolist()`,
    `bool(t)`, `nonzero`, mask indexing, `repeat_interleave(tensor)`, `unique`, the fp32
    `_grouped_mm` fallback, ...) are host reads: recorded, and a fault while capturing;
  * a copy of host data into a captured region is a fault (the graph would replay the
    capture-time source).
- Device-to-host copies are recorded and their host destination is filled with a placeholder
  value (`fill`, default 1), so the host logic downstream (token ids, accept counts, finite
  flags) keeps going with plausible values.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                          FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .record import Record, Transfer, call_site

aten = torch.ops.aten

# GEMM-like ops: every floating tensor operand must have one dtype on CUDA.
_GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
          aten.mv.default, aten.addmv.default, aten.dot.default, aten._grouped_mm.default,
          aten._scaled_dot_product_efficient_attention.default,
          aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default}
# index argument position → dtypes the CUDA kernel takes
_INDEX_DTYPES = {
    aten.gather.default: (2, (torch.int64,)),
    aten.scatter.src: (2, (torch.int64,)), aten.scatter.value: (2, (torch.int64,)),
    aten.scatter_.src: (2, (torch.int64,)), aten.scatter_.value: (2, (torch.int64,)),
    aten.scatter_add.default: (2, (torch.int64,)), aten.scatter_add_.default: (2, (torch.int64,)),
    aten.scatter_reduce.two: (2, (torch.int64,)), aten.scatter_reduce_.two: (2, (torch.int64,)),
    aten.index_select.default: (2, (torch.int64, torch.int32)),
    aten.index_add.default: (2, (torch.int64, torch.int32)), aten.index_add_.default: (2, (torch.int64, torch.int32)),
    aten.index_copy.default: (2, (torch.int64,)), aten.index_copy_.default: (2, (torch.int64,)),
    aten.embedding.default: (1, (torch.int64, torch.int32)),
}
# ops whose output shape depends on the data: a host read on CUDA
_DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default, aten._unique2.default,
                aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor,
                aten.bincount.default}
# indexing ops that take a boolean mask as an index (on CUDA: a nonzero, so a host read)
_MASKABLE = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# ops that return host values computed from device data
_SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
_PINNED: dict[int, weakref.ref] = {}  # id → host tensors allocated as pinned (id-keyed: tensors compare by value)


def _pin(t: torch.Tensor) -> torch.Tensor:
    _PINNED[id(t)] = weakref.ref(t, lambda _, key=id(t): _PINNED.pop(key, None))
    return t


def _is_pinned(t: torch.Tensor) -> bool:
    ref = _PINNED.get(id(t))
    return ref is not None and ref() is t


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _on_cuda(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cuda"


class FakeCudaMode(TorchDispatchMode):
    def __init__(self, record: Record, fill: int = 1):
        super().__init__()
        self.record, self.fill = record, fill
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = _tensors(args, kwargs)
        fakes = [t for t in tensors if _is_fake(t)]
        if kwargs.get("pin_memory"):  # host memory is host memory here; remember it was pinned
            kwargs["pin_memory"] = False
            return _pin(self(func, args, kwargs))
        if func in (aten._pin_memory.default, aten.pin_memory.default):
            return _pin(args[0].clone())
        if func is aten.is_pinned.default:
            return _is_pinned(args[0])
        if not fakes and not _on_cuda(kwargs):
            return func(*args, **kwargs)  # host work: real
        return self._device_op(func, args, kwargs, tensors, fakes)

    def __call__(self, func, args, kwargs):
        return self.__torch_dispatch__(func, (), args, kwargs)

    # ---- device ops ------------------------------------------------------------------------------
    def _device_op(self, func, args, kwargs, tensors, fakes):
        if func in (aten.copy_.default, aten._to_copy.default, aten.to.dtype_layout):
            moved = self._transfer(func, args, kwargs)
            if moved is not NotImplemented:
                return moved
        elif func in _SCALAR_READS:
            self._read(func, fakes, sum(t.numel() * t.element_size() for t in fakes))
            return {aten.equal.default: True, aten.is_nonzero.default: True}.get(func, self.fill)
        elif func in _DATA_SHAPED or (func in _MASKABLE and _mask_index(args)):
            self._read(func, fakes, 0)
            raise self.record.fault("data-dependent-shape", f"{func} has an output shape that depends on device data "
                                    "(a host sync on CUDA; it cannot be captured)")
        else:
            self._check_devices(func, tensors)
            self._check_dtypes(func, args, kwargs)
            if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                return self._grouped_mm_fallback(func, args, kwargs)
        args, kwargs = tree_map(self._as_fake, (args, kwargs))
        try:
            with self.fake:
                return func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):  # any op not listed above
            self._read(func, fakes, 0)
            raise self.record.fault("data-dependent-shape", f"{func} depends on device data on the host "
                                    "(a host sync on CUDA; it cannot be captured)") from None

    def _grouped_mm_fallback(self, func, args, kwargs):
        """CUDA's fast grouped GEMM (sm90/sm100) takes bf16 operands only; any other dtype takes
        a fallback that copies `offs` to the host and loops over the groups."""
        self._read(func, [], 0, detail=f"_grouped_mm on {args[0].dtype} operands (CUDA's fallback copies the "
                                       "group offsets to the host)")
        a, b = (self._as_fake(t).to(torch.bfloat16) for t in args[:2])
        rest = tree_map(self._as_fake, (args[2:], kwargs))
        with self.fake:
            return func(a, b, *rest[0], **rest[1]).to(args[0].dtype)

    def _as_fake(self, x):
        """Real (host) tensors enter device ops as fake CPU tensors of the same metadata."""
        if isinstance(x, torch.Tensor) and not _is_fake(x):
            return self.fake.from_tensor(x)
        return x

    def _transfer(self, func, args, kwargs):
        """Copies between host and device: recorded, checked, and carried out on the host side."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_fake(src) and not _is_fake(dst):  # device → host
                blocking = not (len(args) > 2 and args[2] or kwargs.get("non_blocking")) or not _is_pinned(dst)
                self._read(func, [src], src.numel() * src.element_size(), blocking=blocking)
                with torch.no_grad():
                    dst.fill_(self.fill)
                return dst
            if _is_fake(dst) and not _is_fake(src):  # a host copy (0-dim too: a synchronous copy on CUDA)
                self._write(func, src)
            return NotImplemented
        src = args[0]
        to_cuda = _on_cuda(kwargs) or (kwargs.get("device") is None and _is_fake(src))
        if _is_fake(src) and not to_cuda:  # .cpu() / .to("cpu")
            self._read(func, [src], src.numel() * src.element_size())
            dtype = kwargs.get("dtype") or src.dtype
            return torch.full(src.shape, self.fill, dtype=dtype)
        if not _is_fake(src) and to_cuda:
            self._write(func, src)
        return NotImplemented

    def _read(self, func, fakes, nbytes: int, detail: str | None = None, blocking: bool = True) -> None:
        if self.record.capturing:
            raise self.record.fault("host-read-in-capture", (detail or f"{func} reads device data on the host")
                                    + " while a CUDA graph is being captured")
        from . import current_runtime

        current_runtime().sync_seen(detail or str(func), "d2h", nbytes, blocking)

    def _write(self, func, src: torch.Tensor) -> None:
        if self.record.capturing:
            raise self.record.fault("host-data-in-capture", f"{func} copies host data {tuple(src.shape)} into a "
                                    "captured region (the graph would replay the capture-time contents)")
        self.record.transfers.append(Transfer("h2d", str(func), call_site(), src.numel() * src.element_size()))

    # ---- checks ------------------------------------------------------------------------------------
    def _check_devices(self, func, tensors) -> None:
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        if len(devices) > 1:
            raise self.record.fault("devices", f"{func} mixes tensors on {sorted(map(str, devices))}")
        for i, t in enumerate(tensors):
            if t.device.type != "cpu" or _is_fake(t):
                continue
            if func in _MASKABLE and i > 0 and t.dim() > 0:  # CPU indices: CUDA copies them over
                self._write(func, t)
                continue
            if t.dim() > 0:  # 0-dim CPU tensors are scalars (Python numbers wrapped by torch), as on CUDA
                raise self.record.fault("cpu-tensor", f"{func} got a CPU tensor {tuple(t.shape)} {t.dtype} among "
                                        "cuda tensors")

    def _check_dtypes(self, func, args, kwargs) -> None:
        if func in _GEMMS:
            n = 3 if func in (aten._scaled_dot_product_efficient_attention.default,
                              aten._scaled_dot_product_flash_attention.default,
                              aten._scaled_dot_product_cudnn_attention.default) else None
            operands = [a for a in (args[:n] if n else args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            dtypes = {a.dtype for a in operands}
            if len(dtypes) > 1:
                raise self.record.fault("dtype", f"{func} on mixed operand dtypes {sorted(map(str, dtypes))}")
            if func is aten._grouped_mm.default:
                offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
                if offs is not None and offs.dtype != torch.int32:
                    raise self.record.fault("dtype", f"_grouped_mm offsets must be int32 on CUDA, got {offs.dtype}")
        rule = _INDEX_DTYPES.get(func)
        if rule is not None:
            pos, allowed = rule
            index = args[pos] if len(args) > pos else None
            if isinstance(index, torch.Tensor) and index.dtype not in allowed:
                raise self.record.fault("dtype", f"{func} index of dtype {index.dtype} (CUDA takes "
                                        f"{', '.join(map(str, allowed))})")
        if func is aten.index.Tensor:
            for index in args[1]:
                if index is not None and index.dtype not in (torch.int64, torch.int32):
                    raise self.record.fault("dtype", f"aten.index index of dtype {index.dtype}")


def _mask_index(args) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
