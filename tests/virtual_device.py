"""A second device for CPU-only tests: tensors that compute on the CPU but report `VIRTUAL` as their device, and
that refuse to meet a CPU tensor in one operation, as a CUDA tensor refuses a CPU one. Code that builds an input
on the CPU for a model on another device, or concatenates states from two devices, fails here as it would on GPUs.

    with virtual_device():
        model.to(VIRTUAL)                      # every parameter and buffer moves there
        model(ids.to(VIRTUAL))                 # fine
        model(ids)                             # DeviceMismatch: a CPU tensor met a VIRTUAL one

VIRTUAL is torch's "lazy" device type, which nothing in Eyas or transformers treats specially (unlike "meta",
which transformers uses while loading). Inside the context, a factory call or `.to()` naming VIRTUAL makes a
VIRTUAL tensor; `.to("cpu")`, `.cpu()`, `.item()` and `.tolist()` bring values back; an op mixing a VIRTUAL tensor
with a CPU tensor of one or more dimensions raises (a 0-dim CPU tensor is a scalar, as CUDA allows).
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

VIRTUAL = torch.device("lazy")
_ops = torch.ops.aten
# ops that take tensors on two devices by design: the copies between devices, and an index on the CPU
_CROSS_DEVICE = {_ops._to_copy.default, _ops.copy_.default, _ops.index.Tensor, _ops.index_put_.default,
                 _ops.index_put.default}


class DeviceMismatch(RuntimeError):
    pass


class OnVirtual(torch.Tensor):
    """A CPU tensor (`inner`) that reports VIRTUAL."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=VIRTUAL, requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    def __repr__(self):
        return f"OnVirtual({self.inner!r})"

    def tolist(self):  # a device tensor's values, as .cpu().tolist() (torch refuses tolist on subclasses)
        return self.inner.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _is_virtual(device) -> bool:
    return device is not None and torch.device(device) == VIRTUAL


def _run(func, args, kwargs):
    if func is _ops._has_compatible_shallow_copy_type.default:
        return False  # Module.to swaps a parameter for its VIRTUAL copy instead of sharing a CPU storage
    wrappers: dict[int, OnVirtual] = {}
    cpu: list[tuple[int, ...]] = []

    def unwrap(x):
        if isinstance(x, OnVirtual):
            wrappers[id(x.inner)] = x
            return x.inner
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            cpu.append(tuple(x.shape))
        if isinstance(x, torch.device) and x == VIRTUAL:
            return torch.device("cpu")
        return x

    a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if wrappers and cpu and func not in _CROSS_DEVICE:
        raise DeviceMismatch(f"{func}: tensors on {VIRTUAL} and a CPU tensor of shape {cpu[0]}")
    out = func(*a, **k)
    if func is _ops._local_scalar_dense.default:
        return out
    to = kwargs.get("device")
    if to is not None and not _is_virtual(to):
        return out  # moved to the CPU (to.dtype_layout returns its CPU argument itself)

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if func._schema.is_mutable and id(x) in wrappers:
            return wrappers[id(x)]  # an in-place op returns its own argument
        return OnVirtual(x)

    return tree_map(wrap, out)


class _Dispatch(TorchDispatchMode):
    """Routes every op that involves a VIRTUAL tensor or names VIRTUAL (factories, `.to`) through `_run`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_virtual(kwargs.get("device")) or any(isinstance(x, OnVirtual) for x in tree_leaves((args, kwargs))):
            return _run(func, args, kwargs)
        return func(*args, **kwargs)


def _names_virtual(x) -> bool:
    return isinstance(x, (str, torch.device)) and _is_virtual(x)


class _Moves(TorchFunctionMode):
    """A call naming VIRTUAL (a factory's `device=`, `tensor.to(VIRTUAL)`) would meet torch's check that the
    backend exists before any dispatch: it runs on the CPU instead, and its tensors become VIRTUAL."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = _names_virtual(kwargs.get("device")) or (func is torch.Tensor.to and any(map(_names_virtual, args)))
        if not named:
            return func(*args, **kwargs)
        args = tuple("cpu" if _names_virtual(a) else a for a in args)
        out = func(*args, **{**kwargs, **({"device": "cpu"} if "device" in kwargs else {})})
        return tree_map(lambda x: x if isinstance(x, OnVirtual) or not isinstance(x, torch.Tensor) else OnVirtual(x),
                        out)


@contextlib.contextmanager
def virtual_device():
    # torch.autocast refuses the "lazy" type even disabled; VIRTUAL's values are computed on the CPU, so autocast
    # for VIRTUAL is CPU autocast
    real = torch.autocast.__init__

    def autocast(self, device_type, *args, **kwargs):
        real(self, "cpu" if device_type == VIRTUAL.type else device_type, *args, **kwargs)

    with mock.patch.object(torch.autocast, "__init__", autocast), _Moves(), _Dispatch():
        yield
