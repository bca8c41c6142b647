"""The on-disk layouts ``load_quantized`` reads, one module each, behind one registry (``docs/checkpoints.md``).

A layout turns a checkpoint's ``quantization_config`` into a :class:`Reading`: which tensor suffixes belong
to a quantized weight, which ``.weight`` dtypes mark one, which modules the checkpoint says it left
unquantized, which parts are activation scales (recorded; static per-tensor FP8 ones applied), and how one weight's tensors become
a :class:`~ds_fpquant.QuantizedTensor`. The reader (``ds_fpquant/checkpoint/reader.py``) knows nothing else
about layouts.

A new layout is one module that calls :func:`register` with its ``quant_method`` value(s) and a function
``(qconfig, path) -> Reading`` (and, for layouts whose description lives outside ``config.json``, e.g.
ModelOpt's ``hf_quant_config.json``, :func:`register_config_finder`), imported at the end of this file.
"""

from ds_fpquant.checkpoint.layouts import compressed_tensors, modelopt, native  # noqa: F401  (they register)
from ds_fpquant.checkpoint.layouts.registry import (
    Reading,
    StaticActivationScalesWarning,
    UnsharedInputScalesWarning,
    find_qconfig,
    ignore_matches,
    input_scale_value,
    reading_for,
    register,
    register_config_finder,
)

__all__ = ["Reading", "StaticActivationScalesWarning", "UnsharedInputScalesWarning", "register", "register_config_finder", "reading_for",
           "find_qconfig", "ignore_matches", "input_scale_value"]
