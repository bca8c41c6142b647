"""transformers' front door for ds_fpquant: ``quant_method: "ds_fpquant"`` in ``from_pretrained`` (an ``HfQuantizer``,
:mod:`.quantizer`, with its config :class:`~ds_fpquant.integration.hf.config.DsFpQuantConfig`) and LoRA adapters on
quantized layers (:mod:`.lora`).

``import ds_fpquant`` does not import transformers: it calls :func:`install`, which registers the method at once if
transformers' quantizer registry (``transformers.quantizers.auto``) is already imported, and otherwise when it is
(an import hook that runs :func:`register` right after that module is executed). :func:`register` may also be called
by hand; it is idempotent.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["METHOD", "register", "install"]

#: The ``quant_method`` of ds_fpquant's own checkpoint layout and of :class:`DsFpQuantConfig`.
METHOD = "ds_fpquant"

_REGISTRY_MODULE = "transformers.quantizers.auto"


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


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``transformers.quantizers.auto`` with the other finders and runs :func:`register` once it is executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot: the registry module is imported once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            register()
        except Exception as exc:  # transformers must import even if ds_fpquant cannot register with it
            warnings.warn(f"ds_fpquant could not register quant_method {METHOD!r} with transformers: {exc!r}; "
                          f"call ds_fpquant.integration.hf.register() to see the error", stacklevel=2)


def install() -> None:
    """Register now if transformers' quantizer registry is imported, else when it is (what ``import ds_fpquant``
    runs; it imports nothing from transformers)."""
    if _REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
