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

from ds_fpquant.linear import linear as fused_linear
from ds_fpquant.linear.w8a8 import check_activation, check_input_scale
from ds_fpquant.nn.quantized_params import COMPUTE_DTYPES, buffer_views, register_buffers
from ds_fpquant.numerics.formats import WHOLE
from ds_fpquant.tensor.quantize import quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["FPQuantizedLinear"]


class FPQuantizedLinear(torch.nn.Module):
    """Linear layer with an FP-quantized weight (row grouping along ``in_features``).

    Build it with :meth:`from_linear` (or from a :class:`QuantizedTensor` of the ``(out, in)`` weight).
    Buffers: ``weight_codes`` (uint8, ``(out, row_bytes)``), ``weight_scales`` (uint8: the fp32
    scales' bytes, or the E8M0 / e4m3 scale bytes) and, for NVFP4, ``weight_tensor_scale`` (uint8, the
    fp32 tensor scale's 4 bytes); ``bias`` stays a floating parameter.

    Static per-tensor W8A8 (``activation="e4m3"`` with ``input_scale``, SPEC 8.3): the activation scale is the
    buffer ``input_scale``, a 0-dim fp32 tensor in the state dict; ``model.half()`` / ``.to(dtype)`` keep it fp32
    (a device move takes it along).
    """

    def __init__(self, qt: QuantizedTensor, bias: Optional[torch.Tensor], compute_dtype: Optional[str] = None,
                 backend: str = "auto", activation: Optional[str] = None,
                 input_scale: Optional[torch.Tensor] = None):
        super().__init__()
        if len(qt.shape) != 2:
            raise ValueError(f"FPQuantizedLinear holds a 2-D weight, got shape {tuple(qt.shape)}")
        check_activation(activation, qt, input_scale)  # W8A8 (ds_fpquant.linear.linear): checked before any forward
        #: None (weight-only) or "e4m3": activations quantized to e4m3 (W8A8, opt-in): per token in groups of 128,
        #: or, with the ``input_scale`` buffer, statically per tensor
        self.activation = activation
        self.out_features, self.in_features = qt.shape
        self.fmt, self.group_size, self.orig_dtype = qt.fmt, qt.group_size, qt.dtype
        self.scale_format, self.block = qt.scale_format, qt.block
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype] if compute_dtype else None
        self.backend = backend
        register_buffers(self, "weight", [qt], stacked=False)
        self._scales_shape = tuple(qt.scales.shape)
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        #: static per-tensor W8A8: the activation scale (0-dim fp32 buffer), else None
        self.static = input_scale is not None
        self.register_buffer("input_scale", input_scale.detach().clone() if self.static else None)

    def _apply(self, fn, recurse=True):
        """As ``nn.Module._apply``, but ``input_scale`` keeps its fp32 bits under dtype casts (``model.half()``):
        only its device follows."""
        scale = self._buffers.get("input_scale")
        result = super()._apply(fn, recurse)
        if scale is not None:
            moved = self._buffers["input_scale"]
            self._buffers["input_scale"] = scale.to(moved.device) if moved.dtype != scale.dtype else moved
        return result

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "e4m3", group_size: Optional[int] = None, *,
                    compute_dtype: Optional[str] = None, backend: str = "auto", activation: Optional[str] = None,
                    input_scale: Optional[torch.Tensor] = None, **quantize_kwargs):
        """Quantize ``linear.weight`` (``(out, in)``, groups along ``in``) and keep its bias.

        ``group_size=None`` is 128, or a preset's own; ``quantize_kwargs`` go to
        :func:`ds_fpquant.quantize` (``block``, ``scale_format``, ``rounding``, ``seed``, ...).
        ``input_scale`` (0-dim fp32, with ``activation="e4m3"``): static per-tensor W8A8.
        """
        check_activation(activation, input_scale=input_scale)
        qt = quantize(linear.weight.detach(), fmt, group_size, backend=backend, **quantize_kwargs)
        return cls(qt, linear.bias, compute_dtype=compute_dtype, backend=backend, activation=activation,
                   input_scale=input_scale)

    @property
    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a :class:`QuantizedTensor` (views of the buffers)."""
        meta = dict(shape=torch.Size((self.out_features, self.in_features)), scales_shape=self._scales_shape,
                    dtype=self.orig_dtype, fmt=self.fmt, group_size=self.group_size, scale_format=self.scale_format,
                    block=self.block)
        return buffer_views(self, "weight", meta, stacked=False)[0]

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes (``weight_codes``, uint8), under the name that quantized-layer tooling (PEFT's LoRA
        wrappers, as for GPTQ layers) reads to find the device of a quantized layer."""
        return self.weight_codes

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
                            activation=self.activation, input_scale=self.input_scale).to(x.dtype)

    # state_dict round trip: the format travels with the buffers
    def get_extra_state(self) -> Dict[str, Any]:
        return {"fmt": self.fmt, "group_size": self.group_size, "shape": (self.out_features, self.in_features),
                "scale_format": self.scale_format, "block": self.block, "activation": self.activation,
                "static": self.static, "orig_dtype": str(self.orig_dtype).replace("torch.", "")}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """As ``nn.Module``'s, but a static layer's incoming ``input_scale`` is checked before it is copied: a refused
        load leaves the layer's scale as it was."""
        incoming = state_dict.get(prefix + "input_scale")
        if self.static and isinstance(incoming, torch.Tensor):
            check_input_scale(incoming)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        mine = self.get_extra_state()
        if state.get("activation") != self.activation:  # W8A8 changes the numerics: never switched silently
            raise ValueError(f"state_dict was saved with activation={state.get('activation')!r}; this module has "
                             f"activation={self.activation!r} (build it with the same activation)")
        if bool(state.get("static", False)) != self.static:
            raise ValueError(f"state_dict was saved {'with' if state.get('static') else 'without'} a static "
                             f"input_scale; this module has {'one' if self.static else 'none'} (build it with the same "
                             f"activation and input_scale)")
        keys = ("fmt", "group_size", "scale_format", "block")
        if {k: state.get(k) for k in keys} != {k: mine[k] for k in keys} or tuple(state.get("shape", ())) != mine["shape"]:
            raise ValueError(f"state_dict holds fmt={state.get('fmt')!r}, group_size={state.get('group_size')}, "
                             f"shape={state.get('shape')}; this module is {mine}")
        if self.static:  # the loaded scale is checked as a constructor argument would be
            check_input_scale(self.input_scale)
        self.orig_dtype = getattr(torch, state.get("orig_dtype", "float32"))

    def extra_repr(self) -> str:
        if self.block is not None and tuple(self.block) == (WHOLE, WHOLE):
            scaling = "granularity=tensor"
        elif self.block is None and self.group_size == WHOLE:
            scaling = "granularity=channel"
        else:
            scaling = f"block={self.block}" if self.block else f"group_size={self.group_size}"
        w8a8 = f", activation={self.activation}" if self.activation else ""
        w8a8 += f", input_scale={float(self.input_scale):g}" if self.static and not self.input_scale.is_meta else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}, {scaling}{w8a8}")
