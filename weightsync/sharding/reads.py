"""Which box of a tensor a loader reads, found by running the loader on a tensor without data.

An inference engine's weight loader takes a checkpoint tensor whole and keeps a slice of
it (vLLM's ``weight_loader``: ``narrow`` to this rank's rows or columns, ``chunk`` a fused
tensor, ``select`` an expert, then ``param.copy_(slice)``). ``ReadRecorder`` stands in for
the checkpoint tensor: it carries the shape and dtype but no bytes, follows every op whose
result is a *view* of it (worked out on a meta tensor of the same shape, so any view op
torch knows, ``narrow``, indexing, ``chunk``, ``split``, ``select``, ``transpose``,
``view`` that keeps the elements' places, is followed without a table of ops), and notes the
box of the original tensor that each copy out of it reads. Anything else (arithmetic,
``item()``, ``cat``, a copy into the recorder) would need the bytes: the op raises
``Unreducible`` and the caller takes that tensor whole. Ops that keep every element where
it is but make a new tensor (``contiguous``, ``clone``, ``to``) are followed as the view
they were applied to.

So the receiver asks the trainer for exactly the box its loader reads, and hands the loader
a tensor of the full shape whose box holds the received bytes (``read_box``): the loader
narrows to the same box and never looks outside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box


class Unreducible(RuntimeError):
    """A loader did something with a recorded tensor that needs its bytes."""


#: ops that make a new tensor with every element where it was: followed as their input
_SAME_ELEMENTS = {
    torch.Tensor.contiguous,
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.type_as,
    torch.Tensor.detach,
    torch.detach,
}
#: metadata: answered from the recorder's own shape, dtype and device
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
    torch.Tensor.is_floating_point,
    torch.Tensor.get_device,
    torch.Tensor.__hash__,
    torch.Tensor.__format__,
    torch.Tensor.__repr__,
}
#: attributes that are views (the others are metadata)
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag"}
#: copies whose source a recorder may be: the reads
_COPIES = {torch.Tensor.copy_, torch.Tensor.__setitem__}


def _is_getter(func: Any) -> bool:
    return getattr(func, "__name__", "") == "__get__"


class _Reads:
    """What the loaders read of one checkpoint tensor."""

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        self.base = torch.empty(spec.shape, dtype=spec.torch_dtype, device="meta")
        self.boxes: list[Box] = []


def view_box(view: torch.Tensor, base: torch.Tensor) -> tuple[Box, tuple[int | None, ...]]:
    """The box of ``base`` (contiguous, on meta) that ``view`` covers, and the base dimension
    each of the view's dimensions runs along (None: a dimension of one element); raises
    ``Unreducible`` when its elements are not one box, each once."""
    shape = tuple(base.shape)
    strides = base.stride()
    if view.numel() == 0:
        return Box(tuple(0 for _ in shape), tuple(0 for _ in shape)), tuple(None for _ in view.shape)
    # the view's offset as a start per base dimension (strides are mixed radix)
    offset, starts = view.storage_offset(), []
    for n, s in zip(shape, strides):
        starts.append(offset // s if n > 1 else 0)
        offset -= starts[-1] * s if n > 1 else 0
    if offset:
        raise Unreducible("the view does not start on an element")
    lengths = [1] * len(shape)
    taken: list[int | None] = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            taken.append(None)
            continue
        dims = [d for d, (n, s) in enumerate(zip(shape, strides)) if s == stride and n > 1 and d not in taken]
        if not dims:
            raise Unreducible(f"a view with stride {stride} reads no single dimension")
        taken.append(dims[0])
        lengths[dims[0]] = size
    box = Box(tuple(starts), tuple(lengths))
    if not Box.whole(shape).contains(box) or box.numel != view.numel():
        raise Unreducible("the view's elements are not one box")
    return box, tuple(taken)


class ReadRecorder(torch.Tensor):
    """A checkpoint tensor without bytes that records which box of it loaders read."""

    # public names (no tensor attribute has them): the module's functions read them
    recorded: _Reads
    meta_view: torch.Tensor  # a meta view of ``recorded.base``: where this tensor's elements are

    @staticmethod
    def __new__(cls, reads: _Reads, view: torch.Tensor, dtype: torch.dtype | None = None) -> ReadRecorder:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]  # noqa: SLF001 -- torch 2.13: the only constructor of a wrapper subclass
            cls, tuple(view.shape), dtype=dtype or view.dtype, device="cpu", requires_grad=False
        )
        out.recorded, out.meta_view = reads, view
        return out

    def __init__(self, reads: _Reads, view: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        super().__init__()

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ReadRecorder({self.recorded.spec.name}, {tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        attribute = getattr(getattr(func, "__self__", None), "__name__", "") if _is_getter(func) else ""
        if attribute == "data":
            return args[0]
        if func in _METADATA or (attribute and attribute not in _VIEW_ATTRIBUTES):
            # attributes (shape, dtype, device, ...) and metadata: the wrapper holds them
            if func is torch.Tensor.__repr__:
                return args[0].__repr__()
            with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001 -- torch 2.13: no public form
                return func(*args, **kwargs)
        if func in _COPIES:
            return cls._copy(func, args, kwargs)
        recorders = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, ReadRecorder)]
        if func in _SAME_ELEMENTS and len(recorders) == 1 and args and args[0] is recorders[0]:
            me = recorders[0]
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return ReadRecorder(me.recorded, me.meta_view, dtype or me.dtype)
        # anything else: on meta; the results must be views of the recorded tensor
        reads = {id(r.recorded): r.recorded for r in recorders}
        if len(reads) != 1:
            raise Unreducible(f"{getattr(func, '__name__', func)} combines recorded tensors")
        (only,) = reads.values()
        if func is torch.cat or func is torch.stack:  # a new tensor, even of one view
            raise Unreducible(f"{func.__name__} makes a tensor that is not a view")
        swap = lambda a: a.meta_view if isinstance(a, ReadRecorder) else a  # noqa: E731
        try:
            with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001 -- torch 2.13: no public form
                out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
        except Unreducible:
            raise
        except Exception as e:  # an op that needs data fails on meta (item, numpy, ...)
            raise Unreducible(f"{getattr(func, '__name__', func)}: {e}") from e

        def wrap(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                base = t._base  # noqa: SLF001 -- torch 2.13: a view's base has no public accessor
                if not (t.is_meta and base is not None and base is only.base or t is only.base):
                    raise Unreducible(f"{getattr(func, '__name__', func)} makes a tensor that is not a view")
                return ReadRecorder(only, t)
            return t

        return tree_map(wrap, out)

    @staticmethod
    def _copy(func: Any, args: Any, kwargs: Any) -> Any:
        dest, src = (args[0], args[1]) if func is torch.Tensor.copy_ else (args[0], args[2])
        if isinstance(dest, ReadRecorder) or not isinstance(src, ReadRecorder):
            raise Unreducible("a copy into a recorded tensor")
        src.recorded.boxes.append(view_box(src.meta_view, src.recorded.base)[0])
        return dest if func is torch.Tensor.copy_ else None  # nothing is written: a dry run

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # only reached past __torch_function__ (a C++ path): it would need the bytes
        raise Unreducible(f"{func} reached the recorded tensor's (absent) data")


def recorder(spec: TensorSpec) -> ReadRecorder:
    """A stand-in for the checkpoint tensor ``spec`` whose reads are recorded."""
    reads = _Reads(spec)
    return ReadRecorder(reads, reads.base)


def read_box(tensor: ReadRecorder) -> Box | None:
    """The smallest box covering every read of ``tensor``'s checkpoint tensor (None: none)."""
    boxes = [b for b in tensor.recorded.boxes if b.numel]
    if not boxes:
        return None
    starts = tuple(min(b.starts[d] for b in boxes) for d in range(len(boxes[0].starts)))
    ends = tuple(max(b.ends[d] for b in boxes) for d in range(len(boxes[0].starts)))
    return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


def dry_run(spec: TensorSpec, load: Callable[[torch.Tensor], Any]) -> tuple[Box, str | None]:
    """The box of ``spec`` that ``load`` reads, and why it is whole where it is (None when
    the box was derived). ``load`` gets a recorder; anything it does that a box cannot
    describe, or no read at all, means the tensor is taken whole (fail closed)."""
    whole = Box.whole(spec.shape)
    if not math.prod(spec.shape):
        return whole, None
    rec = recorder(spec)
    try:
        load(rec)
    except Unreducible as e:
        return whole, str(e)
    except Exception as e:  # the loader itself refused the stand-in
        return whole, f"{type(e).__name__}: {e}"
    box = read_box(rec)
    if box is None:
        return whole, "the loader read nothing of it"
    return box, None


def in_full_shape(spec: TensorSpec, box: Box, part: torch.Tensor) -> torch.Tensor:
    """What a loader whose reads are ``box`` takes for ``spec``: a tensor of the full shape
    whose box holds ``part`` (the rest is never read: left uninitialized, so on the CPU its
    pages are not even touched)."""
    if box == Box.whole(spec.shape):
        return part.view(spec.shape)
    full = torch.empty(spec.shape, dtype=part.dtype, device=part.device)
    full[tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))].copy_(part.view(box.lengths))
    return full
