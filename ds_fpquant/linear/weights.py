"""Storage-less tensor subclasses that stand in for a quantized weight (``module.weight`` of an in-place
quantized layer, each expert of a quantized expert stack): the calls they can run quantized (``F.linear``,
``matmul`` / ``mm`` by the transposed weight) go to :func:`ds_fpquant.linear.linear`; casts, transposes and expert
indexing give stand-ins again; metadata is read without dequantizing; every other use sees the dequantized weight,
and another matrix product warns (:class:`QuantizedFallbackWarning`). ``docs/linear.md`` lists the calls.

The ops are recognised as what ``__torch_function__`` receives for them (:func:`_op`), so a wrapper that a
profiler or tracing shim puts around ``torch.nn.functional.linear`` or ``torch.matmul`` changes nothing (issue 35).
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ds_fpquant.linear.functional import linear
from ds_fpquant.numerics.checks import FLOAT_DTYPES
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["DequantizingTensor", "QuantizedWeight", "QuantizedExperts", "QuantizedFallbackWarning"]


class QuantizedFallbackWarning(UserWarning):
    """A matrix product with a quantized weight (:class:`QuantizedWeight`, :class:`QuantizedExperts`) that the
    quantized linear does not run (``torch.mm`` of an untransposed weight, ``einsum``, ``bmm``, ...): it is computed
    with the dequantized weight, ``dequantize(W, dtype)`` (SPEC 5), not by SPEC 8.1's formula, and for a W8A8 weight
    without quantizing the activations (SPEC 8.3). Warned once per call site."""


# ---- which op ``__torch_function__`` was given ----------------------------------------------------------------------
#
# A C function (``torch._C._nn.linear``, ``torch._C._VariableFunctions.matmul``) passes itself, the original, even when
# ``torch.nn.functional.linear`` or ``torch.matmul`` has since been replaced by a wrapper (a profiler, a tracing shim):
# those originals are taken from ``torch._C``, where no such wrapper reaches; a wrapper of the C function itself is
# followed down its ``__wrapped__`` chain. A Tensor method or property passes the attribute ``torch.Tensor.<name>``
# as it is at call time (a wrapped method arrives as its wrapper), so those are also compared with the current
# attributes. What an object is, once found, is remembered (an op object's role does not change).

_ORIGINALS: Dict[object, str] = {}
_METHODS: Dict[str, str] = {}
_PROPERTIES: Dict[str, str] = {}
_SEEN: Dict[object, Optional[str]] = {}


def _register(op: str, functions=(), methods=(), properties=(), module=torch._C._VariableFunctions, objects=()):
    """Op ``op`` is the C functions ``module.<f>``, the ``torch.Tensor`` methods and properties named, and
    ``objects``."""
    for f in functions:
        if hasattr(module, f):
            _ORIGINALS[getattr(module, f)] = op
    for m in methods:
        if hasattr(torch._C.TensorBase, m):
            _ORIGINALS[getattr(torch._C.TensorBase, m)] = op
        _METHODS[m] = op
    for p in properties:
        _ORIGINALS[getattr(torch._C.TensorBase, p).__get__] = op
        _PROPERTIES[p] = op
    for o in objects:
        _ORIGINALS[o] = op


_register("linear", ("linear",), module=torch._C._nn)
_register("matmul", ("matmul",), ("matmul", "__matmul__"))
_register("mm", ("mm",), ("mm",))
_register("transpose", ("transpose",), ("transpose",))
_register("flip", ("t",), ("t",), ("T",))
_register("mT", properties=("mT",))
_register("getitem", methods=("__getitem__",))
_register("select", methods=("select",))
_register("unbind", ("unbind",), ("unbind",))
#: dtype casts: a stand-in of the new compute dtype (``x.float() @ w.float()`` keeps the layer's numerics)
_CASTS = ("to", "float", "half", "bfloat16", "type")
for _cast in _CASTS:
    _register(_cast, methods=(_cast,))
#: no-ops on a stand-in, which holds no gradient and no strides of its own
_register("identity", methods=("detach", "contiguous"))
#: answered from the stand-in's own metadata (the dequantized weight's), without dequantizing it
_register("metadata", methods=("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                               "__len__"),
          properties=("shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "requires_grad"))
#: the other matrix products: a stand-in in one of these is computed dequantized, with a warning
_register("product", ("bmm", "baddbmm", "addbmm", "addmm", "addmv", "mv", "dot", "inner", "chain_matmul",
                      "_grouped_mm", "bilinear", "einsum", "tensordot"),
          ("bmm", "baddbmm", "addbmm", "addmm", "addmv", "mv", "dot", "inner", "__rmatmul__"),
          objects=(torch.functional.einsum, torch.functional.tensordot, torch._C._linalg.linalg_multi_dot))
_register("product", ("bilinear",), module=torch._C._nn)


def _classify(func) -> Optional[str]:
    f = func
    for _ in range(32):  # a wrapper of the C function itself: its __wrapped__ chain
        try:
            op = _ORIGINALS.get(f)
        except TypeError:  # unhashable
            op = None
        if op is not None or not hasattr(f, "__wrapped__"):
            break
        f = f.__wrapped__
    if op is None:
        op = next((o for m, o in _METHODS.items() if func == getattr(torch.Tensor, m, None)), None)
    if op is None:
        op = next((o for p, o in _PROPERTIES.items() if func == getattr(torch.Tensor, p).__get__), None)
    return op


def _op(func) -> Optional[str]:
    """The op ``func`` is (``"linear"``, ``"matmul"``, ..., ``"product"``), or ``None`` for any other."""
    try:
        return _SEEN[func]
    except KeyError:
        op = _SEEN[func] = _classify(func)
        return op
    except TypeError:  # unhashable
        return _classify(func)


_PRODUCT_OPS = ("linear", "matmul", "mm", "product")
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` from the caller of this function that names the first frame outside
    torch and ds_fpquant: the user's call site."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _cast_dtype(self: torch.Tensor, cast: str, args, kwargs) -> Optional[torch.dtype]:
    """The compute dtype of a dtype-only cast of ``self`` (``.float()``, ``.half()``, ``.bfloat16()``,
    ``.to(dtype)``, ``.to(dtype=...)``, ``.to(same_device, dtype)``, ``.type(dtype)``), if it is one of
    fp32, fp16, bf16; ``None`` for any other call (another device, ``copy=True``, ``memory_format``, other dtypes)."""
    kwargs = dict(kwargs)
    kwargs.pop("non_blocking", None)
    if kwargs.pop("copy", False):
        return None
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    if cast in fixed:
        dtype = fixed[cast] if not args and kwargs.get("memory_format", torch.preserve_format) is             torch.preserve_format else None
    elif cast == "type":
        dtype = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype) else None
    else:  # to
        dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
        if kwargs:
            return None
        for a in args:
            if isinstance(a, torch.dtype) and dtype is None:
                dtype = a
            elif isinstance(a, (str, torch.device, int)) and device is None:
                device = a
            elif isinstance(a, torch.Tensor) and dtype is None and device is None:
                dtype, device = a.dtype, a.device
            else:
                return None
        if device is not None and torch.device(device) != self.device:
            return None
    return dtype if dtype in FLOAT_DTYPES else None


def _expert_index(index) -> Optional[int]:
    """``e`` of ``experts[e]``, ``experts[e, :, :]`` / ``[e, ...]`` (an int, a numpy int, a 0-dim integer tensor),
    else ``None``."""
    if isinstance(index, tuple) and index and all(i == slice(None) or i is Ellipsis for i in index[1:]) and \
            not any(isinstance(i, torch.Tensor) for i in index[1:]):
        index = index[0]
    if isinstance(index, bool) or (isinstance(index, torch.Tensor) and (index.dim() or index.is_floating_point()
                                                                         or index.dtype == torch.bool)):
        return None
    try:
        return operator.index(index)
    except TypeError:
        return None


def _linear_arguments(args, kwargs) -> Tuple[object, object, object, bool]:
    """``(input, weight, bias, understood)`` of an ``F.linear`` call, positional or by keyword."""
    names = ("input", "weight", "bias")
    if len(args) > 3 or set(kwargs) - set(names[len(args):]):
        return None, None, None, False
    bound = dict(zip(names, args), **kwargs)
    return bound.get("input"), bound.get("weight"), bound.get("bias"), "input" in bound and "weight" in bound


class DequantizingTensor(torch.Tensor):
    """Base of the storage-less tensor subclasses that stand in for a quantized weight (:class:`QuantizedWeight`,
    :class:`QuantizedExperts`): a subclass handles the calls it runs quantized in its
    ``__torch_function__`` and passes the rest to :meth:`_dense_call`, which sees :meth:`dequantized`."""

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _dense(value):
        return value.dequantized() if isinstance(value, DequantizingTensor) else value

    def numerics(self) -> str:
        """What the quantized linear would have computed, for :class:`QuantizedFallbackWarning`."""
        raise NotImplementedError

    @classmethod
    def _dense_call(cls, func, args, kwargs, op: Optional[str] = None):
        """``func`` on the dequantized weights; a matrix product warns first (:class:`QuantizedFallbackWarning`);
        metadata (``shape``, ``dtype``, ``size()``, ...) is the stand-in's own, nothing dequantized."""
        if op == "metadata":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        held = None if op not in _PRODUCT_OPS else next(
            (a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, DequantizingTensor)), None)
        if held is not None:
            name = getattr(func, "__name__", op)
            warnings.warn(f"{name} with {held!r} is not a call the quantized linear runs (F.linear(x, w), x @ w.T, "
                          f"torch.matmul / mm by the transposed weight): computed with the dequantized weight instead "
                          f"of {held.numerics()}", QuantizedFallbackWarning, stacklevel=_user_stacklevel())
        args = torch.utils._pytree.tree_map(cls._dense, args)
        kwargs = torch.utils._pytree.tree_map(cls._dense, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = torch.utils._pytree.tree_map(cls._dense, args)
        kwargs = torch.utils._pytree.tree_map(cls._dense, kwargs or {})
        return func(*args, **kwargs)


class QuantizedWeight(DequantizingTensor):
    """An ``(out, in)`` weight held as codes + scales, standing in for ``module.weight`` in layers whose
    forward is ``torch.matmul(x, self.weight.transpose(-1, -2))`` or ``F.linear(x, self.weight)``
    (DeepSpeed's AutoTP ``LinearLayer`` / ``LinearAllreduce``): those calls run :func:`linear` (the
    fused op on CPU tensors). Any other use of the tensor sees ``dequantize(qt, dtype)``. ``activation`` and
    ``input_scale`` (a 0-dim fp32 tensor: static per-tensor W8A8, SPEC 8.3) go to :func:`linear` as given.

    A tensor subclass without storage (``torch.Tensor._make_wrapper_subclass``): shape, dtype and
    device are the dequantized weight's.
    """

    @staticmethod
    def __new__(cls, qt: QuantizedTensor, dtype: torch.dtype, backend: str = "auto", transposed: bool = False,
                activation: Optional[str] = None, input_scale: Optional[torch.Tensor] = None):
        n, k = qt.shape
        self = torch.Tensor._make_wrapper_subclass(cls, (k, n) if transposed else (n, k), dtype=dtype,
                                                   device=qt.codes.device, requires_grad=False)
        # plain attributes: the Tensor properties (dtype, shape) of a subclass go through __torch_function__
        self.qt, self.backend, self.transposed, self.weight_dtype = qt, backend, transposed, dtype
        self.activation, self.input_scale = activation, input_scale
        return self

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, backend: str = "auto", transposed: bool = False,
                 activation: Optional[str] = None, input_scale: Optional[torch.Tensor] = None):
        super().__init__()

    def __repr__(self, *, tensor_contents=None):
        n, k = self.qt.shape
        return (f"QuantizedWeight(shape={(k, n) if self.transposed else (n, k)}, dtype={self.weight_dtype}, "
                f"fmt={self.qt.fmt})")

    def dequantized(self) -> torch.Tensor:
        w = dequantize(self.qt, self.weight_dtype, backend=self.backend)
        return w.t() if self.transposed else w

    def _flipped(self) -> "QuantizedWeight":
        return type(self)(self.qt, self.weight_dtype, self.backend, not self.transposed, self.activation,
                          self.input_scale)

    def numerics(self) -> str:
        if self.input_scale is not None:
            return f"static W8A8 (activations quantized to {self.activation} with input_scale, SPEC 8.3)"
        if self.activation is not None:
            return f"W8A8 (activations quantized to {self.activation}, SPEC 8.1)"
        return "SPEC 8.1's formula (exact codes, group sums times the scales, fp32)"

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W^T + bias`` by :func:`linear`, in the weight's (compute) dtype, returned in ``x``'s (as
        ``FPQuantizedLinear.forward`` does)."""
        return linear(x.to(self.weight_dtype), self.qt, bias, backend=self.backend, activation=self.activation,
                      input_scale=self.input_scale).to(x.dtype)

    def _as(self, dtype: torch.dtype) -> "QuantizedWeight":
        return type(self)(self.qt, dtype, self.backend, self.transposed, self.activation, self.input_scale)

    @staticmethod
    def _is_input(x) -> bool:
        return isinstance(x, torch.Tensor) and not isinstance(x, DequantizingTensor)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _op(func)
        this = args[0] if args and isinstance(args[0], cls) else None
        if op in ("linear", "matmul", "mm") and isinstance(args[0] if args else kwargs.get("input"), torch.Tensor) \
                and not (args[0] if args else kwargs["input"]).is_floating_point():
            return cls._dense_call(func, args, kwargs)  # an integer x: torch's own dtype error, as for a plain weight
        if op == "linear":
            x, w, bias, understood = _linear_arguments(args, kwargs)
            if understood and isinstance(w, cls) and not w.transposed and cls._is_input(x) and \
                    not isinstance(bias, DequantizingTensor):
                return w._linear(x, bias)
        elif op in ("matmul", "mm") and len(args) == 2 and not kwargs:
            x, w = args
            if isinstance(w, cls) and w.transposed and cls._is_input(x) and (op == "matmul" or x.dim() == 2):
                return w._linear(x)
        elif this is None:
            pass
        elif op == "transpose" and len(args) == 3 and not kwargs:
            if sorted(d % 2 for d in args[1:3]) == [0, 1]:
                return this._flipped()
        elif op in ("flip", "mT") and len(args) == 1 and not kwargs:
            return this._flipped()
        elif op == "identity" and len(args) == 1 and not kwargs:
            return this
        elif op in _CASTS:
            dtype = _cast_dtype(this, op, args[1:], kwargs)
            if dtype is not None:
                return this._as(dtype)
        return cls._dense_call(func, args, kwargs, op)


class QuantizedExperts(DequantizingTensor):
    """``(E, out, in)`` expert weights held as per-expert codes + scales; ``experts[e]`` is expert ``e``'s
    :class:`~ds_fpquant.linear.weights.QuantizedWeight`. A tensor subclass without storage.

    ``transposed=True``: the parameter it stands in for is ``(E, in, out)`` (gpt-oss's ``GptOssExperts``,
    whose forward is ``x @ w[e]``); each expert's :class:`QuantizedTensor` is still its ``(out, in)`` matrix
    (groups along ``in``), and ``experts[e]`` is that weight transposed, so ``x @ experts[e]`` runs the
    quantized linear.

    ``input_scale`` (a 0-dim fp32 tensor, with ``activation="e4m3"``): the stack's one static per-tensor activation
    scale (SPEC 8.3), given to every expert's :class:`QuantizedWeight`."""

    @staticmethod
    def __new__(cls, experts: List[QuantizedTensor], dtype: torch.dtype, backend: str = "auto",
                activation: Optional[str] = None, transposed: bool = False, input_scale: Optional[torch.Tensor] = None):
        n, k = experts[0].shape
        self = torch.Tensor._make_wrapper_subclass(cls, (len(experts), k, n) if transposed else (len(experts), n, k),
                                                   dtype=dtype, device=experts[0].codes.device, requires_grad=False)
        self.experts, self.weight_dtype, self.backend, self.activation = experts, dtype, backend, activation
        self.transposed, self.input_scale = transposed, input_scale
        return self

    def __init__(self, experts, dtype, backend="auto", activation=None, transposed=False, input_scale=None):
        super().__init__()

    def __repr__(self, *, tensor_contents=None):
        n, k = self.experts[0].shape
        shape = (len(self.experts), k, n) if self.transposed else (len(self.experts), n, k)
        return f"QuantizedExperts(shape={shape}, dtype={self.weight_dtype}, fmt={self.experts[0].fmt})"

    def dequantized(self) -> torch.Tensor:
        weights = [dequantize(qt, self.weight_dtype, backend=self.backend) for qt in self.experts]
        return torch.stack([w.t() for w in weights] if self.transposed else weights)

    def numerics(self) -> str:
        return self._expert(0).numerics()

    def _expert(self, e: int) -> QuantizedWeight:
        return QuantizedWeight(self.experts[e], self.weight_dtype, self.backend, self.transposed,
                               activation=self.activation, input_scale=self.input_scale)

    def _like(self, dtype: Optional[torch.dtype] = None, transposed: Optional[bool] = None) -> "QuantizedExperts":
        return type(self)(self.experts, dtype or self.weight_dtype, self.backend, self.activation,
                          self.transposed if transposed is None else transposed, self.input_scale)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _op(func)
        this = args[0] if args and isinstance(args[0], cls) else None
        if this is None:
            pass
        elif op == "getitem" and len(args) == 2 and not kwargs:
            e = _expert_index(args[1])
            if e is not None:
                return this._expert(e)
        elif op == "select":
            bound = dict(zip(("dim", "index"), args[1:]), **kwargs)
            if set(bound) == {"dim", "index"} and bound["dim"] in (0, -3) and _expert_index(bound["index"]) is not None:
                return this._expert(_expert_index(bound["index"]))
        elif op == "unbind" and len(args) <= 2 and set(kwargs) <= {"dim"}:
            if dict(zip(("dim",), args[1:]), **kwargs).get("dim", 0) in (0, -3):
                return tuple(this._expert(e) for e in range(len(this.experts)))
        elif op == "transpose" and len(args) == 3 and not kwargs:
            if sorted(d % 3 for d in args[1:3]) == [1, 2]:
                return this._like(transposed=not this.transposed)
        elif op == "mT" and len(args) == 1 and not kwargs:
            return this._like(transposed=not this.transposed)
        elif op == "identity" and len(args) == 1 and not kwargs:
            return this
        elif op in _CASTS:
            dtype = _cast_dtype(this, op, args[1:], kwargs)
            if dtype is not None:
                return this._like(dtype=dtype)
        return cls._dense_call(func, args, kwargs, op)
