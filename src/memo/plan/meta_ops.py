"""Ops on `meta` tensors answered from a memo of their outputs: what a traced step costs is its op calls, not their
sizes, and most meta kernels run in Python (`torch._meta_registrations` puts `torch._refs` in place of the C++
ones: ~100 µs an elementwise op), while a step repeats the same few hundred calls for every layer, tile and head
chunk. A meta kernel's outputs depend only on the call's arguments and its tensors' shapes, strides and dtypes, so a
repeated call gets new tensors of the shapes, strides and dtypes the kernel gave the first time (`empty_strided`,
a C++ op) without running it again.

Only calls that read nothing but `meta` tensors are remembered: one that returns new storages gets new tensors alike;
one that writes its arguments (in place, `out=`: `is_mutable`) and leaves their shapes, strides and offsets as they
were returns the argument it wrote (on `meta` a write moves nothing). Views, and every call on a real device, run as
they are. Tests compare traces made with and without the memo, event by event.
"""

from __future__ import annotations

import torch

from ..device import meta_kernel_type

META = torch.device("meta")
_RUN = object()  # a call whose outputs are not remembered: run it every time
_OUTPUTS: dict = {}  # call signature -> how to answer it (`_describe`), or _RUN
_MUTABLE: dict = {}  # op -> whether its schema writes an argument


class NotMeta(Exception):
    """A call reads a tensor off `meta`, or returns what the memo cannot make again."""


def call(func, args: tuple, kwargs: dict) -> tuple[object, bool]:
    """Returns (`func(*args, **kwargs)`, whether its tensors are all new storages: none is an argument's)."""
    key = _signature(func, args, kwargs)
    known = _RUN if key is None else _OUTPUTS.get(key)
    if known is _RUN:
        return func(*args, **kwargs), False
    if known is not None:
        return _rebuild(known, args, kwargs), known[0] != "written"
    if _MUTABLE[func]:
        offsets = _offsets(args, kwargs)
        out = func(*args, **kwargs)
        unchanged = _signature(func, args, kwargs) == key and _offsets(args, kwargs) == offsets
        _OUTPUTS[key] = _returned_argument(out, args, kwargs) if unchanged else _RUN
        return out, False
    out = func(*args, **kwargs)
    _OUTPUTS[key] = _describe(out, storages((args, kwargs)))
    return out, _OUTPUTS[key] is not _RUN


def _signature(func, args: tuple, kwargs: dict):
    """Returns what a meta kernel's outputs depend on (None for a call not remembered): the op, its arguments with
    each tensor as (shape, stride, dtype), the default dtype and whose kernels meta stands for."""
    if func not in _MUTABLE:
        if not isinstance(func, torch._ops.OpOverload):
            return None
        _MUTABLE[func] = func._schema.is_mutable
    try:
        key = (func, *map(_leaf, args), _leaf(kwargs), torch.get_default_dtype(), meta_kernel_type())
        hash(key)
    except (NotMeta, TypeError):  # a real tensor, or an argument that cannot be a key
        return None
    return key


def _leaf(x):
    kind = type(x)
    if kind is int or kind is float or kind is bool or x is None:
        return (kind, x)  # 1, 1.0 and True promote differently
    if kind is torch.Tensor or isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise NotMeta
        return (x.shape, x.stride(), x.dtype)
    if kind is list or kind is tuple:
        if all(type(y) is int for y in x):  # sizes, dims
            return (kind, "ints", *x)
        return (kind, *map(_leaf, x))
    if kind is dict:
        return tuple((k, _leaf(v)) for k, v in x.items())
    return (kind, x)


def _offsets(args: tuple, kwargs: dict) -> tuple:
    return tuple(x.storage_offset() for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))


def storages(tree) -> list[int]:
    """Returns the storages of the tensors in nested tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree.untyped_storage()._cdata]
    if isinstance(tree, (tuple, list)):
        return [s for x in tree for s in storages(x)]
    if isinstance(tree, dict):
        return [s for x in tree.values() for s in storages(x)]
    return []


def _returned_argument(out, args: tuple, kwargs: dict):
    """Returns where a call that writes its arguments, and changed none of their shapes, finds the tensors it
    returns: ("arg", i) or ("kwarg", name) (a tuple of those for a tuple); _RUN for anything else."""
    places = [("arg", i, x) for i, x in enumerate(args)] + [("kwarg", k, x) for k, x in kwargs.items()]

    def place(t):
        return next(((kind, at) for kind, at, x in places if x is t), None)

    found = [place(t) for t in out] if type(out) is tuple else [place(out)]
    if None in found:
        return _RUN
    return ("written", tuple(found) if type(out) is tuple else found[0])


def _describe(out, inputs: list[int]):
    """Returns the tree of `out` as ("tensor", shape, stride, dtype) and ("value", x) leaves, or _RUN unless each
    tensor is a plain meta tensor on a new storage of its own that `empty_strided` makes alike."""
    outputs = storages(out)
    if len(set(outputs)) < len(outputs) or set(outputs) & set(inputs):
        return _RUN
    try:
        desc = _tree(out)
    except NotMeta:
        return _RUN
    return desc if _same(out, _rebuild(desc, (), {})) else _RUN


def _tree(out):
    if out is None or type(out) in (int, float, bool):
        return ("value", out)
    if type(out) is torch.Tensor and out.device.type == "meta" and not out.requires_grad:
        return ("tensor", tuple(out.shape), out.stride(), out.dtype)
    if type(out) in (tuple, list):
        return ("tree", type(out), *(_tree(x) for x in out))
    raise NotMeta  # a subclass, a real tensor, a value of another kind


def _rebuild(desc, args: tuple, kwargs: dict):
    kind = desc[0]
    if kind == "tensor":
        return torch.empty_strided(desc[1], desc[2], dtype=desc[3], device=META)
    if kind == "value":
        return desc[1]
    if kind == "written":
        return _argument(desc[1], args, kwargs)
    return desc[1](_rebuild(x, args, kwargs) for x in desc[2:])


def _argument(at: tuple, args: tuple, kwargs: dict):
    if type(at[0]) is tuple:
        return tuple(_argument(x, args, kwargs) for x in at)
    return args[at[1]] if at[0] == "arg" else kwargs[at[1]]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
