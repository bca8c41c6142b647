"""Storage-less tensor subclasses that stand in for a quantized weight (``module.weight`` of an in-place
quantized layer, each expert of a quantized expert stack): the calls they can run quantized (``F.linear``,
``matmul`` / ``mm`` by the transposed weight) go to :func:`ds_fpquant.linear.linear`; every other use sees the
dequantized weight, and another matrix product warns (:class:`QuantizedFallbackWarning`).

The ops are recognised as what ``__torch_function__`` receives for them (:class:`_TorchOp`), so a wrapper that a
profiler or tracing shim puts around ``torch.nn.functional.linear`` or ``torch.matmul`` changes nothing (issue 35).
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Tuple

import torch

from ds_fpquant.linear.functional import linear
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["DequantizingTensor", "QuantizedWeight", "QuantizedExperts", "QuantizedFallbackWarning"]


class QuantizedFallbackWarning(UserWarning):
    """A matrix product with a quantized weight (:class:`QuantizedWeight`, :class:`QuantizedExperts`) that the
    quantized linear does not run (``torch.mm`` of an untransposed weight, ``einsum``, ``bmm``, ...): it is computed
    with the dequantized weight, ``dequantize(W, dtype)`` (SPEC 5), not by SPEC 8.1's formula, and for a W8A8 weight
    without quantizing the activations (SPEC 8.3). Warned once per call site."""


class _TorchOp:
    """The objects ``__torch_function__`` receives for one torch op, however the op is reached.

    A C function (``torch._C._nn.linear``, ``torch._C._VariableFunctions.matmul``) passes itself, the original, even
    when ``torch.nn.functional.linear`` or ``torch.matmul`` has since been replaced by a wrapper (a profiler, a tracing
    shim): those are kept here, taken from ``torch._C`` where no wrapper reaches. A Tensor method or property passes
    the attribute ``torch.Tensor.<name>`` as it is at call time (a wrapped method arrives as its wrapper), so
    ``methods`` are looked up on every call; the originals of ``torch._C.TensorBase`` are kept too."""

    def __init__(self, name: str, originals: Tuple[Callable, ...], methods: Tuple[str, ...] = (),
                 properties: Tuple[str, ...] = ()):
        self.name, self.originals, self.methods, self.properties = name, originals, methods, properties

    def __call__(self, func) -> bool:
        # ``==``: a property's ``__get__`` is a new method-wrapper at each lookup, equal to the others
        return (any(func == f for f in self.originals)
                or any(func == getattr(torch.Tensor, m, None) for m in self.methods)
                or any(func == getattr(torch.Tensor, p).__get__ for p in self.properties))


def _op(name: str, functions=(), methods=(), properties=(), module=torch._C._VariableFunctions) -> _TorchOp:
    """``name``'s :class:`_TorchOp`: the C functions ``module.<f>`` for ``f`` in ``functions``, the methods of
    ``torch._C.TensorBase`` and the properties' getters, as originals; ``methods``/``properties`` also at call time."""
    originals = tuple(getattr(module, f) for f in functions if hasattr(module, f))
    originals += tuple(getattr(torch._C.TensorBase, m) for m in methods if hasattr(torch._C.TensorBase, m))
    originals += tuple(getattr(torch._C.TensorBase, p).__get__ for p in properties)
    return _TorchOp(name, originals, tuple(methods), tuple(properties))


_LINEAR = _op("F.linear", ("linear",), module=torch._C._nn)
_MATMUL = _op("matmul", ("matmul",), ("matmul", "__matmul__"))
_MM = _op("mm", ("mm",), ("mm",))
_TRANSPOSE = _op("transpose", ("transpose",), ("transpose",))
_FLIP = _op("t", ("t",), ("t",), ("T", "mT"))
_GETITEM = _op("__getitem__", methods=("__getitem__",))
#: the other matrix products: a quantized weight in one of these is computed dequantized, with a warning
_PRODUCTS = (_LINEAR, _MATMUL, _MM,
             _op("bmm", ("bmm", "baddbmm", "addbmm", "addmm", "addmv", "mv", "dot", "inner", "chain_matmul",
                         "_grouped_mm", "bilinear"),
                 ("bmm", "baddbmm", "addbmm", "addmm", "addmv", "mv", "dot", "inner", "__rmatmul__")),
             _TorchOp("einsum", (torch.functional.einsum, torch.functional.tensordot, torch._C._linalg.linalg_multi_dot,
                                 torch._C._nn.bilinear if hasattr(torch._C._nn, "bilinear") else torch.bilinear)))


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
    def _dense_call(cls, func, args, kwargs):
        """``func`` on the dequantized weights; a matrix product among :data:`_PRODUCTS` warns first."""
        product = next((op for op in _PRODUCTS if op(func)), None)
        held = [] if product is None else [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                                           if isinstance(a, DequantizingTensor)]
        if held:
            name = getattr(func, "__name__", product.name)
            warnings.warn(f"{name} with {held[0]!r} is not a call the quantized linear runs (F.linear(x, w), "
                          f"x @ w.T, torch.matmul / mm by the transposed weight): computed with the dequantized "
                          f"weight instead of {held[0].numerics()}", QuantizedFallbackWarning, stacklevel=3)
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

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _TRANSPOSE(func) and args and isinstance(args[0], cls) and len(args) == 3 and not kwargs:
            if sorted(d % 2 for d in args[1:3]) == [0, 1]:
                return args[0]._flipped()
        if _FLIP(func) and len(args) == 1 and isinstance(args[0], cls) and not kwargs:
            return args[0]._flipped()
        if len(args) == 2 and not kwargs and (_MATMUL(func) or _MM(func)):
            x, w = args
            if (isinstance(w, cls) and w.transposed and isinstance(x, torch.Tensor)
                    and not isinstance(x, DequantizingTensor) and (x.dim() == 2 or not _MM(func))):
                return w._linear(x)
        if _LINEAR(func):
            x, w, bias, understood = _linear_arguments(args, kwargs)
            if (understood and isinstance(w, cls) and not w.transposed and isinstance(x, torch.Tensor)
                    and not isinstance(x, DequantizingTensor) and not isinstance(bias, DequantizingTensor)):
                return w._linear(x, bias)
        return cls._dense_call(func, args, kwargs)


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
        return self[0].numerics()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _GETITEM(func) and len(args) == 2 and isinstance(args[0], cls) and not kwargs:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int):
                self = args[0]
                return QuantizedWeight(self.experts[index], self.weight_dtype, self.backend, self.transposed,
                                       activation=self.activation, input_scale=self.input_scale)
        return cls._dense_call(func, args, kwargs)
