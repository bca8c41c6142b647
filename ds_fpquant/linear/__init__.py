"""Layer 4, linear: the functional quantized linear :func:`linear` (docs/api.md), its weight-only and W8A8 forwards, the
``torch.library`` custom ops, and the tensor subclasses that stand in for a quantized weight."""

from ds_fpquant.linear.functional import linear
from ds_fpquant.linear.weights import QuantizedFallbackWarning

__all__ = ["linear", "QuantizedFallbackWarning"]
