"""``FPQuantizedLinear``: an ``nn.Linear`` whose weight is stored as FP codes + scales.

The weight is dequantized on the fly in ``forward`` (SPEC 5) to ``compute_dtype`` (default: the
activation's dtype). Codes are a ``uint8`` buffer; the scales are kept as bytes in a ``uint8``
buffer (fp32 scales as their little-endian bytes, SPEC 6.1; E8M0 bytes and NVFP4 e4m3 codes as
they are; the NVFP4 fp32 tensor scale as its 4 bytes), so ``model.half()`` / ``.to(dtype)`` cannot
round them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import checks
from .api import quantize
from .quantized_tensor import QuantizedTensor
from .choices import ACTIVATIONS, COMPUTE_DTYPE_NAMES
from .linear import QuantizedWeight, check_w8a8_weight
from .linear import linear as fused_linear

__all__ = ["FPQuantizedLinear", "install_quantized_weight", "quantize_weight_in_place", "is_weight_quantized"]

#: ``compute_dtype`` name -> dtype (the names: :data:`ds_fpquant.choices.COMPUTE_DTYPE_NAMES`).
COMPUTE_DTYPES = dict(zip(COMPUTE_DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16)))


def _register_weight_buffers(module: torch.nn.Module, qt: QuantizedTensor) -> None:
    """``weight_codes``, ``weight_scales`` (bytes) and, for NVFP4, ``weight_tensor_scale`` (4 bytes)."""
    module.register_buffer("weight_codes", qt.codes)
    module.register_buffer("weight_scales", qt.scales.contiguous().view(torch.uint8))
    if qt.tensor_scale is not None:
        module.register_buffer("weight_tensor_scale", qt.tensor_scale.reshape(1).view(torch.uint8))


def _weight_view(module: torch.nn.Module, shape, dtype, fmt, group_size, scale_format, block) -> QuantizedTensor:
    """The weight buffers of ``module`` as a :class:`QuantizedTensor` (views, no copies)."""
    scales = module.weight_scales.view(torch.float32) if scale_format == "fp32" else module.weight_scales
    t = getattr(module, "weight_tensor_scale", None)
    return QuantizedTensor(codes=module.weight_codes, scales=scales, shape=torch.Size(shape), dtype=dtype, fmt=fmt,
                           group_size=group_size, scale_format=scale_format, block=block,
                           tensor_scale=None if t is None else t.view(torch.float32).reshape(()))


class FPQuantizedLinear(torch.nn.Module):
    """Linear layer with an FP-quantized weight (row grouping along ``in_features``).

    Build it with :meth:`from_linear` (or from a :class:`QuantizedTensor` of the ``(out, in)`` weight).
    Buffers: ``weight_codes`` (uint8, ``(out, row_bytes)``), ``weight_scales`` (uint8: the fp32
    scales' bytes, or the E8M0 / e4m3 scale bytes) and, for NVFP4, ``weight_tensor_scale`` (uint8, the
    fp32 tensor scale's 4 bytes); ``bias`` stays a floating parameter.
    """

    def __init__(self, qt: QuantizedTensor, bias: Optional[torch.Tensor], compute_dtype: Optional[str] = None,
                 backend: str = "auto", activation: Optional[str] = None):
        super().__init__()
        if len(qt.shape) != 2:
            raise ValueError(f"FPQuantizedLinear holds a 2-D weight, got shape {tuple(qt.shape)}")
        if activation is not None:  # W8A8 (ds_fpquant.linear.linear): checked here, before any forward
            checks.check_choice("activation", activation, ACTIVATIONS)
            check_w8a8_weight(qt)
        #: None (weight-only) or "e4m3": activations quantized per token to e4m3 (W8A8, opt-in)
        self.activation = activation
        self.out_features, self.in_features = qt.shape
        self.fmt, self.group_size, self.orig_dtype = qt.fmt, qt.group_size, qt.dtype
        self.scale_format, self.block = qt.scale_format, qt.block
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype] if compute_dtype else None
        self.backend = backend
        _register_weight_buffers(self, qt)
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "e4m3", group_size: Optional[int] = None, *,
                    compute_dtype: Optional[str] = None, backend: str = "auto", activation: Optional[str] = None,
                    **quantize_kwargs):
        """Quantize ``linear.weight`` (``(out, in)``, groups along ``in``) and keep its bias.

        ``group_size=None`` is 128, or a preset's own; ``quantize_kwargs`` go to
        :func:`ds_fpquant.quantize` (``block``, ``scale_format``, ``rounding``, ``seed``, ...).
        """
        if activation is not None:
            checks.check_choice("activation", activation, ACTIVATIONS)
        qt = quantize(linear.weight.detach(), fmt, group_size, backend=backend, **quantize_kwargs)
        return cls(qt, linear.bias, compute_dtype=compute_dtype, backend=backend, activation=activation)

    @property
    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a :class:`QuantizedTensor` (views of the buffers)."""
        return _weight_view(self, (self.out_features, self.in_features), self.orig_dtype, self.fmt, self.group_size,
                            self.scale_format, self.block)

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.quantized_weight.dequantize(dtype or self.orig_dtype, backend=self.backend)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (codes + scales + NVFP4 tensor scale), all uint8 buffers."""
        return sum(b.numel() for n, b in self.named_buffers() if n.startswith("weight_"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias`` with ``W = dequantize(weight, compute_dtype)`` (default: ``x``'s dtype), decoded
        on the fly (:func:`ds_fpquant.linear.linear`: the fused CPU op on CPU tensors)."""
        dtype = self.compute_dtype or x.dtype
        return fused_linear(x.to(dtype), self.quantized_weight, self.bias, backend=self.backend,
                            activation=self.activation).to(x.dtype)

    # state_dict round trip: the format travels with the buffers
    def get_extra_state(self) -> Dict[str, Any]:
        return {"fmt": self.fmt, "group_size": self.group_size, "shape": (self.out_features, self.in_features),
                "scale_format": self.scale_format, "block": self.block, "activation": self.activation,
                "orig_dtype": str(self.orig_dtype).replace("torch.", "")}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        mine = self.get_extra_state()
        if state.get("activation") != self.activation:  # W8A8 changes the numerics: never switched silently
            raise ValueError(f"state_dict was saved with activation={state.get('activation')!r}; this module has "
                             f"activation={self.activation!r} (build it with the same activation)")
        keys = ("fmt", "group_size", "scale_format", "block")
        if {k: state.get(k) for k in keys} != {k: mine[k] for k in keys} or tuple(state.get("shape", ())) != mine["shape"]:
            raise ValueError(f"state_dict holds fmt={state.get('fmt')!r}, group_size={state.get('group_size')}, "
                             f"shape={state.get('shape')}; this module is {mine}")
        self.orig_dtype = getattr(torch, state.get("orig_dtype", "float32"))

    def extra_repr(self) -> str:
        scaling = f"block={self.block}" if self.block else f"group_size={self.group_size}"
        w8a8 = f", activation={self.activation}" if self.activation else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}, {scaling}{w8a8}")


def is_weight_quantized(module: torch.nn.Module) -> bool:
    """Whether :func:`quantize_weight_in_place` was applied to ``module``."""
    return hasattr(module, "_fpq_weight")


def quantize_weight_in_place(module: torch.nn.Module, fmt: str = "e4m3", group_size: Optional[int] = None, *,
                             compute_dtype: Optional[str] = None, backend: str = "auto", activation: Optional[str] = None,
                             **quantize_kwargs) -> int:
    """Store ``module.weight`` (2-D) as FP codes + scales and dequantize it around each forward.

    For layers that are not plain ``nn.Linear`` but use ``self.weight`` in their forward, such as
    DeepSpeed's AutoTP ``LinearLayer`` / ``LinearAllreduce`` (each rank quantizes its own shard).
    The ``weight`` parameter is replaced by the buffers ``weight_codes`` and ``weight_scales``; a
    forward pre-hook puts a :class:`~ds_fpquant.linear.QuantizedWeight` (``compute_dtype``, default:
    the input's dtype) in place, whose ``matmul`` / ``F.linear`` run the fused op without a dequantized
    copy, and a forward hook drops it again. Returns the bytes of the stored weight.
    """
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(module).__name__}.weight must be a 2-D tensor to be quantized")
    if activation is not None:
        checks.check_choice("activation", activation, ACTIVATIONS)
    qt = quantize(weight.detach(), fmt, group_size, backend=backend, **quantize_kwargs)
    install_quantized_weight(module, qt, compute_dtype=compute_dtype, backend=backend, activation=activation)
    return qt.nbytes


def install_quantized_weight(module: torch.nn.Module, qt: QuantizedTensor, *, compute_dtype: Optional[str] = None,
                             backend: str = "auto", activation: Optional[str] = None) -> None:
    """Make ``qt`` (an ``(out, in)`` weight's codes and scales) the weight of ``module`` as
    :func:`quantize_weight_in_place` does: the ``weight`` parameter (if any) is replaced by the buffers and
    the forward hooks. Used for AutoTP shards of a model that was quantized before it was sharded."""
    if activation is not None:
        checks.check_choice("activation", activation, ACTIVATIONS)
        check_w8a8_weight(qt)
    module._parameters.pop("weight", None)
    _register_weight_buffers(module, qt)
    module._fpq_weight = dict(shape=qt.shape, dtype=qt.dtype, fmt=qt.fmt, group_size=qt.group_size, backend=backend,
                              scale_format=qt.scale_format, block=qt.block,
                              compute_dtype=COMPUTE_DTYPES[compute_dtype] if compute_dtype else None,
                              activation=activation)
    module.weight = None
    module.register_forward_pre_hook(_materialize_weight)
    module.register_forward_hook(_release_weight)


# The hooks of install_quantized_weight: module-level functions (not closures), so that a module holding them
# pickles (torch.save of a whole model) and deep-copies.
def _materialize_weight(mod, args):
    meta = mod._fpq_weight
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    dtype = meta["compute_dtype"] or (x.dtype if x is not None else meta["dtype"])
    view = _weight_view(mod, meta["shape"], meta["dtype"], meta["fmt"], meta["group_size"], meta["scale_format"],
                        meta["block"])
    mod.weight = QuantizedWeight(view, dtype, meta["backend"], activation=meta["activation"])  # the fused op


def _release_weight(mod, args, output):
    mod.weight = None
