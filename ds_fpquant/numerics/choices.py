"""The allowed values of every choice argument, defined once. The native API's checks, the pydantic
``fp_quantization`` section (``Literal`` types built from these), the command line's ``choices`` and the
checkpoint reader all use them; ``tests/unit/test_choices.py`` checks that the CLI offers exactly these."""

from __future__ import annotations

from ds_fpquant.numerics.formats import GRANULARITIES as _GRANULARITIES
from ds_fpquant.numerics.formats import NVFP4_SCALE_FORMAT

#: ``grouping=`` (SPEC 2).
GROUPINGS = ("row", "flat")


#: ``granularity=`` (SPEC 2): one scale per matrix, or one per row (output channel);
#: :func:`ds_fpquant.numerics.formats.resolve_granularity` maps them to blocks / groups.
GRANULARITIES = _GRANULARITIES


#: ``scale_format=`` of the element formats (SPEC 3.1, 3.2).
SCALE_FORMATS = ("fp32", "e8m0")


#: Every ``scale_format`` a quantized tensor can have (NVFP4's group scales are e4m3 codes, SPEC 3.4).
ALL_SCALE_FORMATS = (*SCALE_FORMATS, NVFP4_SCALE_FORMAT)


#: ``layout=`` of the checkpoint writers (docs/checkpoints.md): block FP8, compressed-tensors, NVIDIA ModelOpt,
#: ds_fpquant's own; each is the ``quant_method`` it writes.
LAYOUTS = ("fp8", "compressed-tensors", "modelopt", "ds_fpquant")


#: ``scale_rounding=`` of E8M0 scales (SPEC 3.2).
SCALE_ROUNDINGS = ("ceil", "floor")


#: ``rounding=`` (SPEC 4).
ROUNDINGS = ("nearest", "stochastic")


#: ``backend=``: the compiled op for the tensor's device, a named compiled op, or the torch reference.
BACKENDS = ("auto", "cuda", "cpu", "torch")


#: ``compute_dtype=`` of the quantized layers.
COMPUTE_DTYPE_NAMES = ("fp32", "fp16", "bf16")


#: ``activation=``: the W8A8 activation formats (e4m3 codes, fp32 scales in 1x128 groups per token).
ACTIVATIONS = ("e4m3",)
