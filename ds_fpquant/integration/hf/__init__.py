"""transformers' front door for ds_fpquant: ``quant_method: "ds_fpquant"`` in ``from_pretrained`` (an ``HfQuantizer``,
:mod:`.quantizer`, with its config :class:`~ds_fpquant.integration.hf.config.DsFpQuantConfig`) and LoRA adapters on
quantized layers (:mod:`.lora`).

``import ds_fpquant`` does not import transformers: it calls :func:`ds_fpquant.integration.hf.hook.install`, which
registers the method at once if transformers' quantizer registry (``transformers.quantizers.auto``) is already
imported, and otherwise when it is (an import hook that runs :func:`register` right after that module is executed).
:func:`register` may also be called by hand; it is idempotent.
"""

from __future__ import annotations

__all__ = ["METHOD", "register"]

from ds_fpquant.integration.hf.names import METHOD


def register() -> None:
    """Register ``quant_method: "ds_fpquant"`` with transformers (``register_quantization_config`` and
    ``register_quantizer``) and let ``quantization_config=DsFpQuantConfig(...)`` load checkpoints of the layouts
    transformers owns (``"fp8"``, ``"compressed-tensors"``, ``"mxfp4"``, ModelOpt) through ds_fpquant. Idempotent."""
    from transformers.quantizers import auto

    from ds_fpquant.integration.hf.config import DsFpQuantConfig
    from ds_fpquant.integration.hf.quantizer import DsFpQuantHfQuantizer, merge_quantization_configs

    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not DsFpQuantConfig:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(METHOD, None)  # an older registration (a reloaded module)
        auto.register_quantization_config(METHOD)(DsFpQuantConfig)
    if auto.AUTO_QUANTIZER_MAPPING.get(METHOD) is not DsFpQuantHfQuantizer:
        auto.AUTO_QUANTIZER_MAPPING.pop(METHOD, None)
        auto.register_quantizer(METHOD)(DsFpQuantHfQuantizer)
    merge = auto.AutoHfQuantizer.__dict__["merge_quantization_configs"].__func__
    if getattr(merge, "ds_fpquant_original", None) is None:
        auto.AutoHfQuantizer.merge_quantization_configs = classmethod(merge_quantization_configs(merge))
