"""The name ds_fpquant has in transformers (a module of its own: importing it imports nothing)."""

__all__ = ["METHOD"]

#: The ``quant_method`` of ds_fpquant's own checkpoint layout and of ``DsFpQuantConfig``.
METHOD = "ds_fpquant"
