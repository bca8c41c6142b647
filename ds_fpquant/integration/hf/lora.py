"""LoRA adapters (PEFT) on :class:`~ds_fpquant.nn.quantized_linear.FPQuantizedLinear` layers: the base weight stays
quantized and frozen (its codes and scales are buffers, never trained), the adapters train in full precision, as
DeepSpeed's ``OptimizedLinear`` does over its quantized base weight.

PEFT builds LoRA layers for the layer types it knows; this module gives it one for ``FPQuantizedLinear`` through its
custom-module API (``LoraConfig._register_custom_module``). After ``import ds_fpquant`` a plain ``LoraConfig`` is
enough (:func:`install_dispatch`, run by ds_fpquant's import hook when PEFT's LoRA model is imported)::

    import ds_fpquant
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))

:func:`register_lora` (``get_peft_model(model, register_lora(config))``) does the same for one config by hand.

``forward`` is ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` per active adapter. Merging an adapter into a
quantized weight would change its codes (a re-quantization, with its error): ``merge`` / ``merge_and_unload`` are
refused, unless :func:`merge_and_unload` is asked to dequantize the base layers first.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from peft.tuners.lora.layer import LoraLayer

from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

__all__ = ["LoraFPQuantizedLinear", "register_lora", "install_dispatch", "merge_and_unload"]


class LoraFPQuantizedLinear(torch.nn.Module, LoraLayer):
    """PEFT's LoRA layer over an :class:`FPQuantizedLinear` (``base_layer``): PEFT's arguments (``r``,
    ``lora_alpha``, ``lora_dropout``, ``init_lora_weights``, ``use_rslora``, from the ``LoraConfig``). DoRA and
    ``lora_bias`` are refused (``ValueError``)."""

    def __init__(self, base_layer: torch.nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs) -> None:
        if config.lora_bias or config.use_dora:
            raise ValueError(f"{type(self).__name__}: LoRA over an FP-quantized layer supports plain LoRA; got "
                             f"lora_bias={config.lora_bias}, use_dora={config.use_dora}")
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config, **kwargs):
        return None

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``lora_B @ lora_A * scaling`` (``(out, in)``)."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        base = self.get_base_layer()
        if isinstance(base, FPQuantizedLinear):
            raise ValueError(f"cannot merge a LoRA adapter into the FP-quantized weight of {base!r}: that would "
                             f"re-quantize it (new codes, new rounding error). Keep the adapters separate, or call "
                             f"ds_fpquant.integration.hf.lora.merge_and_unload(model, dequantize=True) to merge into "
                             f"the dequantized weights (plain nn.Linear, full precision)")
        for adapter in adapter_names or self.active_adapters:
            if adapter in self.lora_A:
                delta = self.get_delta_weight(adapter).to(base.weight.dtype)
                if safe_merge and not torch.isfinite(base.weight + delta).all():
                    raise ValueError(f"NaNs or Infs in the merged weights; the adapter {adapter!r} seems broken")
                base.weight.data += delta
                self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        base = self.get_base_layer()
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            base.weight.data -= self.get_delta_weight(adapter).to(base.weight.dtype)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            h = lora_B(lora_A(self.lora_dropout[adapter](x.to(lora_A.weight.dtype))))
            result = result + (h * self.scaling[adapter]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_lora(config):
    """``config`` (a ``peft.LoraConfig``) with :class:`LoraFPQuantizedLinear` registered for
    :class:`FPQuantizedLinear` target modules; returns it."""
    config._register_custom_module({FPQuantizedLinear: LoraFPQuantizedLinear})
    return config


def install_dispatch() -> None:
    """Let ``get_peft_model(model, LoraConfig(...))`` wrap ``FPQuantizedLinear`` targets without
    :func:`register_lora`: PEFT (0.21) picks a LoRA layer through a fixed list of dispatchers in
    ``LoraModel._create_new_module`` and a per-config custom-module map, and has no registry for a new layer type;
    this wraps ``_create_new_module`` so that a target whose base layer is an ``FPQuantizedLinear`` first gets
    :func:`register_lora`'s mapping on its config (a mapping the config already has for the type is kept). Every other
    target goes to PEFT unchanged. Idempotent; run by ``import ds_fpquant``'s import hook."""
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    create = LoraModel.__dict__["_create_new_module"].__func__
    if getattr(create, "ds_fpquant_original", None) is not None:
        return

    @functools.wraps(create)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, FPQuantizedLinear) and FPQuantizedLinear not in (lora_config._custom_modules or {}):
            register_lora(lora_config)
        return create(lora_config, adapter_name, target, **kwargs)

    _create_new_module.ds_fpquant_original = create
    LoraModel._create_new_module = staticmethod(_create_new_module)


def merge_and_unload(model, dequantize: bool = False, dtype: Optional[torch.dtype] = None):
    """PEFT's ``merge_and_unload`` for a model with LoRA adapters over FP-quantized layers: refused (``ValueError``)
    unless ``dequantize=True``, which first replaces each quantized base layer by an ``nn.Linear`` holding its
    dequantized weight (``dtype``: default the dtype it was quantized from), then merges the adapters into it.
    Returns the unloaded base model."""
    if not dequantize:
        raise ValueError("merging LoRA adapters into FP-quantized weights would re-quantize them; pass "
                         "dequantize=True to merge into the dequantized weights (the layers become nn.Linear)")
    from ds_fpquant.integration.hf.dequantize import dequantize_model

    for module in model.modules():
        if isinstance(module, LoraFPQuantizedLinear) and isinstance(module.base_layer, FPQuantizedLinear):
            holder = torch.nn.Module()
            holder.layer = module.base_layer
            dequantize_model(holder, dtype)
            module.base_layer = holder.layer
    return model.merge_and_unload()
