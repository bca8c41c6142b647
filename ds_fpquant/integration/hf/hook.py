"""The import hook ``import ds_fpquant`` installs (:func:`install`): ``quant_method: "ds_fpquant"`` is registered with
transformers (:func:`ds_fpquant.integration.hf.register`) when transformers' quantizer registry is imported, without
importing transformers (or anything else) before that."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install"]

_REGISTRY_MODULE = "transformers.quantizers.auto"


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
        from ds_fpquant.integration.hf import register
        from ds_fpquant.integration.hf.names import METHOD

        try:
            register()
        except Exception as exc:  # transformers must import even if ds_fpquant cannot register with it
            warnings.warn(f"ds_fpquant could not register quant_method {METHOD!r} with transformers: {exc!r}; "
                          f"call ds_fpquant.integration.hf.register() to see the error", stacklevel=2)


def install() -> None:
    """Register now if transformers' quantizer registry is imported, else when it is (what ``import ds_fpquant``
    runs; it imports nothing from transformers)."""
    if _REGISTRY_MODULE in sys.modules:
        from ds_fpquant.integration.hf import register

        register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
