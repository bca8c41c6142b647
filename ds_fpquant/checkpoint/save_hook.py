"""``save_pretrained`` of a quantized model: :func:`enable_save_pretrained` makes it write the model as
:func:`ds_fpquant.save_quantized` does (:class:`QuantizedSavePretrained`, a picklable bound call)."""

from __future__ import annotations

import torch

from ds_fpquant.checkpoint.writer import save_quantized

__all__ = ["enable_save_pretrained", "QuantizedSavePretrained"]


def _save_pretrained(self, save_directory, is_main_process: bool = True, max_shard_size="50GB",
                     safe_serialization: bool = True, **kwargs):
    """``save_pretrained`` of a quantized model: :func:`save_quantized` (installed on the model by
    :func:`ds_fpquant.apply` and :func:`load_quantized`). Arguments it cannot honour are refused by name."""
    from transformers.utils.hub import convert_file_size_to_int

    refused = {k: v for k, v in kwargs.items() if v not in (None, False)}
    if refused or safe_serialization is not True:
        raise ValueError(f"save_pretrained of a ds_fpquant-quantized model writes its codes and scales with "
                         f"ds_fpquant.save_quantized(model, directory) (safetensors, max_shard_size, "
                         f"is_main_process); it cannot honour {refused or {'safe_serialization': safe_serialization}}. "
                         f"Or quantize the original checkpoint with `ds-fpquant quantize SRC DST`")
    if is_main_process:
        save_quantized(self, save_directory, max_shard_bytes=convert_file_size_to_int(max_shard_size))


def enable_save_pretrained(model: torch.nn.Module) -> None:
    """Make ``model.save_pretrained`` (a transformers model's) write the quantized checkpoint
    (:func:`save_quantized`) instead of failing on the quantized layers."""
    if callable(getattr(model, "save_pretrained", None)) and hasattr(getattr(model, "config", None), "to_dict"):
        model.save_pretrained = QuantizedSavePretrained(model)


class QuantizedSavePretrained:
    """``model.save_pretrained`` of a quantized model (:func:`_save_pretrained` bound to ``model``). A plain
    object rather than a bound method, so that the model pickles (``torch.save(model)``; a bound method pickles
    by its name and cannot be found on the unpickled model) and deep-copies."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        return _save_pretrained(self.model, *args, **kwargs)
