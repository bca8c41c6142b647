"""Storage-less tensor subclasses that stand in for a quantized weight (``module.weight`` of an in-place
quantized layer, each expert of a quantized expert stack): the calls they can run quantized (``F.linear``,
``matmul`` by the transposed weight) go to :func:`ds_fpquant.linear.linear`; every other use sees the dequantized
weight.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from ds_fpquant.linear.functional import linear
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["DequantizingTensor", "QuantizedWeight", "QuantizedExperts"]


class DequantizingTensor(torch.Tensor):
    """Base of the storage-less tensor subclasses that stand in for a quantized weight (:class:`QuantizedWeight`,
    :class:`QuantizedExperts`): a subclass handles the calls it runs quantized in its
    ``__torch_function__`` and passes the rest to :meth:`_dense_call`, which sees :meth:`dequantized`."""

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _dense(value):
        return value.dequantized() if isinstance(value, DequantizingTensor) else value

    @classmethod
    def _dense_call(cls, func, args, kwargs):
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

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.transpose, torch.transpose) and isinstance(args[0], cls) and not kwargs:
            if sorted(d % 2 for d in args[1:3]) == [0, 1]:
                return args[0]._flipped()
        if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__) and isinstance(args[0], cls):
            return args[0]._flipped()
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) == 2 and not kwargs:
            x, w = args
            if isinstance(w, cls) and w.transposed and isinstance(x, torch.Tensor) and not isinstance(x, cls):
                # in the weight's (compute) dtype, returned in x's, as FPQuantizedLinear.forward does
                return linear(x.to(w.weight_dtype), w.qt, backend=w.backend, activation=w.activation,
                              input_scale=w.input_scale).to(x.dtype)
        if func is F.linear and len(args) >= 2 and isinstance(args[1], cls) and not args[1].transposed:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not isinstance(args[0], cls) and not isinstance(bias, cls):
                x = args[0]
                w = args[1]
                return linear(x.to(w.weight_dtype), w.qt, bias, backend=w.backend, activation=w.activation,
                              input_scale=w.input_scale).to(x.dtype)
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

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and isinstance(args[0], cls) and not kwargs:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
                index = int(index)
            if isinstance(index, int):
                self = args[0]
                return QuantizedWeight(self.experts[index], self.weight_dtype, self.backend, self.transposed,
                                       activation=self.activation, input_scale=self.input_scale)
        return cls._dense_call(func, args, kwargs)
