"""``DsFpQuantConfig``: the ``quantization_config`` of ``from_pretrained`` for ds_fpquant (``quant_method:
"ds_fpquant"``).

Two uses:

- quantize while loading a full-precision checkpoint: ``DsFpQuantConfig(fmt="nvfp4", exclude=[...])`` takes the
  fields of the ``"fp_quantization"`` section (:class:`ds_fpquant.config.FPQuantizationConfig`: ``fmt``,
  ``group_size``, ``block``, ``granularity``, ``scale_format``, ``rounding``, ``modules``, ``exclude``,
  ``backend``, ``compute_dtype``, ``activation``, ``enabled``) and is checked by the same code;
- a quantized checkpoint: transformers builds it from ``config.json``'s ``quantization_config`` (the layout
  ``ds-fpquant quantize`` writes), kept whole as :attr:`DsFpQuantConfig.checkpoint` and checked by the layout's
  reader when the weights are read. Passed by hand for a checkpoint of a layout transformers owns (``"fp8"``,
  ``"compressed-tensors"``, ``"mxfp4"``), it makes ``from_pretrained`` load that checkpoint through ds_fpquant
  (its ``backend`` and ``compute_dtype`` apply to the layers).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

from ds_fpquant.integration.hf.names import METHOD

__all__ = ["DsFpQuantConfig"]


class DsFpQuantConfig(QuantizationConfigMixin):
    """``quantization_config`` for ``from_pretrained`` (``quant_method: "ds_fpquant"``).

    Args:
        checkpoint: a quantized checkpoint's own ``quantization_config`` (set by transformers from
            ``config.json``, or by ds_fpquant when this config is given for a checkpoint of another layout);
            ``None`` to quantize while loading.
        **fields: the ``"fp_quantization"`` section's fields (:class:`ds_fpquant.config.FPQuantizationConfig`).

    Raises:
        ValueError: an unknown field, a format that does not exist, or settings that contradict each other (the
            message names the field), before any weight is read.
    """

    def __init__(self, checkpoint: Optional[Dict[str, Any]] = None, **fields):
        from ds_fpquant.config import FPQuantizationConfig

        self.quant_method = METHOD
        if checkpoint is not None and not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict (a checkpoint's quantization_config), got "
                            f"{type(checkpoint).__name__}")
        self.checkpoint = copy.deepcopy(checkpoint)
        fields.pop("quant_method", None)
        #: the ``fp_quantization`` section (validated)
        self.section = FPQuantizationConfig(**fields)
        self.fields = dict(fields)

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], return_unused_kwargs: bool = False, **kwargs):
        """From ``config.json``'s ``quantization_config`` (a checkpoint written by ds_fpquant: it carries the
        ``"ds_fpquant"`` record) or from :meth:`to_dict`'s output."""
        config_dict = dict(config_dict)
        if "ds_fpquant" in config_dict:  # a checkpoint's layout description
            config = cls(checkpoint=config_dict)
        else:
            config_dict.pop("quant_method", None)
            checkpoint = config_dict.pop("checkpoint", None)
            config = cls(checkpoint=checkpoint, **config_dict.pop("fp_quantization", {}), **config_dict)
        return (config, kwargs) if return_unused_kwargs else config

    def settings(self):
        """The ``fp_quantization`` section (:class:`ds_fpquant.config.FPQuantizationConfig`)."""
        return self.section

    def to_dict(self) -> Dict[str, Any]:
        """A quantized checkpoint's ``quantization_config`` as read, else ``{"quant_method": "ds_fpquant",
        "fp_quantization": {the given fields}}``."""
        if self.checkpoint is not None and "ds_fpquant" in self.checkpoint:
            return copy.deepcopy(self.checkpoint)
        out: Dict[str, Any] = {"quant_method": METHOD, "fp_quantization": copy.deepcopy(self.fields)}
        if self.checkpoint is not None:
            out["checkpoint"] = copy.deepcopy(self.checkpoint)
        return out

    def to_json_string(self, use_diff: bool = True) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def __repr__(self):
        return f"DsFpQuantConfig({self.to_json_string()})"
