"""The import hooks ``import ds_fpquant`` installs (:func:`install`): ``quant_method: "ds_fpquant"`` is registered with
transformers (:func:`ds_fpquant.integration.hf.register`) when transformers' quantizer registry is imported, and
PEFT's LoRA learns ``FPQuantizedLinear`` (:func:`ds_fpquant.integration.hf.lora.install_dispatch`) when PEFT's LoRA
model is imported, without importing transformers or PEFT (or anything else) before that."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install"]

_REGISTRY_MODULE = "transformers.quantizers.auto"
_LORA_MODULE = "peft.tuners.lora.model"


def _guarded(step: str, instead: str) -> None:
    """Run ``step`` (``"module:function"``, imported only now); a failure warns (naming ``instead``) instead of raising,
    so that the library being imported still imports."""
    module, function = step.split(":")
    try:
        getattr(importlib.import_module(module), function)()
    except Exception as exc:
        warnings.warn(f"ds_fpquant: {step} failed: {exc!r}; {instead}", stacklevel=3)


def _register() -> None:
    _guarded("ds_fpquant.integration.hf:register", "quant_method 'ds_fpquant' is not registered with transformers; "
             "call ds_fpquant.integration.hf.register() to see the error")


def _install_lora_dispatch() -> None:
    _guarded("ds_fpquant.integration.hf.lora:install_dispatch", "PEFT's LoRA does not know FPQuantizedLinear; pass "
             "ds_fpquant.integration.hf.lora.register_lora(config) to get_peft_model instead")


#: module -> what runs right after it is executed
_AFTER_IMPORT = {_REGISTRY_MODULE: _register, _LORA_MODULE: _install_lora_dispatch}


class _RunAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``module`` (one of :data:`_AFTER_IMPORT`) with the other finders and runs its callback once it is
    executed."""

    def __init__(self, module: str):
        self.module = module

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
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
        _AFTER_IMPORT[self.module]()


def install() -> None:
    """For transformers' quantizer registry and PEFT's LoRA model each: hook into it now if it is imported, else when
    it is (what ``import ds_fpquant`` runs; it imports nothing from transformers or PEFT)."""
    for name, callback in _AFTER_IMPORT.items():
        if name in sys.modules:
            callback()
        elif not any(isinstance(finder, _RunAfterImport) and finder.module == name for finder in sys.meta_path):
            sys.meta_path.insert(0, _RunAfterImport(name))
