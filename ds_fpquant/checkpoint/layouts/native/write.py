"""The two layouts ds_fpquant writes (:mod:`.read` describes them): a :class:`~ds_fpquant.QuantizedTensor` as the named
tensors of block FP8 (``quant_method: "fp8"``) or of ``"ds_fpquant"`` (:func:`to_parts`), and ``config.json``'s
``quantization_config`` for them (:func:`quantization_config`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from ds_fpquant.checkpoint.layouts.native.read import FP8_METHOD
from ds_fpquant.numerics.formats import FP8_DTYPES
from ds_fpquant.version import __version__

__all__ = ["to_parts", "quantization_config", "whole_blocks"]


def whole_blocks(shape: Sequence[int], block: Sequence[int]) -> bool:
    """Whether a loader that infers the block from the scales' shape (``rows // scale_rows``, as
    transformers' FP8 loader does) reads a ``shape`` matrix with ``block`` blocks correctly: each side is
    a multiple of its block or fits in one."""
    return all(n <= b or n % b == 0 for n, b in zip(shape, block))


def to_parts(qt, method: str) -> Dict[str, torch.Tensor]:
    """The tensors that store ``qt`` in the checkpoint layout, by name (``weight``, ``weight_scale_inv``,
    ``weight_scale``, ``weight_scale_2``), on the CPU."""
    if method == FP8_METHOD:
        return {"weight": qt.codes.view(FP8_DTYPES[qt.fmt]).cpu(), "weight_scale_inv": qt.scales.cpu()}
    parts = {"weight": qt.codes.cpu(),
             "weight_scale": (qt.scales.view(torch.float8_e4m3fn) if qt.fmt == "nvfp4" else qt.scales).cpu()}
    if qt.tensor_scale is not None:
        parts["weight_scale_2"] = qt.tensor_scale.cpu()
    return parts


def quantization_config(method: str, layout: Dict[str, Any], not_converted: List[str], transposed: List[str],
                         weight_dtype: str) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config`` for a checkpoint in ``method``'s layout."""
    qconfig: Dict[str, Any] = {"quant_method": method, "fmt": layout["fmt"]}
    if method == FP8_METHOD:
        qconfig.update(activation_scheme="dynamic", weight_block_size=layout["weight_block_size"])
    else:
        qconfig.update(layout, codes="uint8, SPEC 6 row packing")
    qconfig.update(modules_to_not_convert=not_converted, ignored_layers=not_converted,
                   ds_fpquant={"version": __version__, "transposed": transposed, "weight_dtype": weight_dtype})
    return qconfig
