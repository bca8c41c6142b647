"""The checkpoint layouts, one subpackage each with the same shape (``docs/checkpoints.md``, ``docs/layout.md``):

- ``native/``: ds_fpquant's own two, block FP8 (``quant_method: "fp8"``, also AutoFP8 per-tensor FP8) and
  ``"ds_fpquant"`` (packed codes);
- ``compressed_tensors/``: compressed-tensors (``"compressed-tensors"``);
- ``modelopt/``: NVIDIA ModelOpt (``"modelopt"``, ``hf_quant_config.json``);
- ``gpt_oss/``: gpt-oss's MXFP4 experts (``"mxfp4"``).

In each, ``read.py`` turns the checkpoint's tensors into :class:`~ds_fpquant.QuantizedTensor` (and holds the layout's
names, which ``write.py`` imports) and ``write.py`` turns a quantized model's tensors into the layout's tensors and
``config.json`` entries, for :mod:`ds_fpquant.checkpoint.writer`.

``registry.py``, beside them, is what the reader sees: a layout's ``read`` module calls :func:`register` with its
``quant_method`` value(s) and a function ``(qconfig, path) -> Reading`` (and, for layouts whose description lives
outside ``config.json``, e.g. ModelOpt's ``hf_quant_config.json``, :func:`register_config_finder`), imported below.
A :class:`Reading` says which tensor suffixes belong to a quantized weight, which ``.weight`` dtypes mark one,
which modules the checkpoint says it left unquantized, which parts are activation scales (recorded; static
per-tensor FP8 ones applied), and how one weight's tensors become a :class:`~ds_fpquant.QuantizedTensor`; every
reader ends with :func:`checked`. The reader (``ds_fpquant/checkpoint/reader.py``) knows nothing else about
layouts. gpt-oss's reader rebuilds the experts modules themselves and is called by the reader before the registry.
"""

from ds_fpquant.checkpoint.layouts.compressed_tensors import read as _compressed_tensors  # noqa: F401  (they register)
from ds_fpquant.checkpoint.layouts.modelopt import read as _modelopt  # noqa: F401
from ds_fpquant.checkpoint.layouts.native import read as _native  # noqa: F401
from ds_fpquant.checkpoint.layouts.registry import (
    Reading,
    StaticActivationScalesWarning,
    UnsharedInputScalesWarning,
    check_scale_values,
    checked,
    find_qconfig,
    ignore_matches,
    input_scale_value,
    reading_for,
    register,
    register_config_finder,
)

__all__ = ["Reading", "StaticActivationScalesWarning", "UnsharedInputScalesWarning", "register", "register_config_finder", "reading_for",
           "find_qconfig", "ignore_matches", "input_scale_value", "checked", "check_scale_values"]
