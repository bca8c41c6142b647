"""gpt-oss's MXFP4 checkpoint layout (``quant_method: "mxfp4"``, openai/gpt-oss-20b / -120b), read (its
names, used by :mod:`.write` too, and :func:`read`).

Only the experts are quantized. For each 3-D expert parameter ``<p>`` of a transposed experts module
(``GptOssExperts``: ``gate_up_proj`` ``(E, hidden, 2*inter)``, ``down_proj`` ``(E, inter, hidden)``, i.e.
``(E, in, out)``) the checkpoint holds, instead of ``<p>``:

- ``<p>_blocks``: ``uint8`` ``(E, out, in/32, 16)``: the e2m1 codes of each expert's ``(out, in)`` matrix
  ``w[e].T``, 32 elements (16 bytes) per group along ``in``, element ``2i`` in the low nibble;
- ``<p>_scales``: ``uint8`` ``(E, out, in/32)``: one E8M0 byte per group, the scale ``2^(byte - 127)``.

Everything else (attention, router, embeddings, head, norms, expert biases, sinks) is stored as it is, and
``quantization_config`` is ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. The rows of
``gate_up_proj``'s ``(out, in)`` matrix are gate and up interleaved (even rows gate, odd rows up:
``GptOssExperts._apply_gate`` takes ``gate_up[..., ::2]`` and ``[..., 1::2]``); groups run along ``in``, so the
interleave does not touch them and the rows are kept in the model's order.

This is exactly ds_fpquant's ``"mxfp4"`` preset (SPEC 3.2 E8M0, groups of 32, SPEC 6 nibble order) of each
``(out, in)`` matrix: ``codes`` ``(out, in/2)`` is ``blocks[e]`` reshaped and ``scales`` is ``scales[e]``, byte
for byte, so reading makes no copy of the weights in another precision and writing stores our codes as they
are. transformers' reader (``convert_moe_packed_tensors``) decodes ``lut[nibble] * 2^(byte - 127)``, which is
SPEC 5 for every finite scale. Quantizing, ds_fpquant rounds ties to even (SPEC 4) where the triton_kernels
quantizer that produced gpt-oss rounds them away from zero, and it stores the scale byte 127 for an all-zero
group where that quantizer stores 0; both decode to the same zeros (``docs/checkpoints.md``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ds_fpquant.checkpoint.hf_files import (
    CONFIG,
    iter_tensors,
    meta_model,
    shard_files,
)
from ds_fpquant.checkpoint.keys import CheckpointKeys
from ds_fpquant.checkpoint.layouts.registry import checked
from ds_fpquant.nn.experts import expert_matrix_shape, install_quantized_experts, is_transposed_experts
from ds_fpquant.numerics import checks
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["GPT_OSS_METHOD", "GPT_OSS_NOT_CONVERTED", "BLOCKS", "SCALES", "GROUP", "is_gpt_oss_qconfig", "is_gpt_oss_model",
           "check_qconfig", "expert_from_parts", "not_converted", "read"]

GPT_OSS_METHOD = "mxfp4"

#: ``modules_to_not_convert`` as openai/gpt-oss-20b and -120b ship it (transformers' pattern rules).
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

BLOCKS, SCALES = "_blocks", "_scales"

GROUP = 32

#: The ``quantization_config`` fields of this layout (``transformers.Mxfp4Config``).
QCONFIG_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")


def is_gpt_oss_qconfig(qconfig) -> bool:
    """Whether ``qconfig`` (a checkpoint's ``quantization_config``) names this layout."""
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == GPT_OSS_METHOD


def is_gpt_oss_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a gpt-oss model (``config.model_type == "gpt_oss"``) with transposed experts."""
    return getattr(getattr(model, "config", None), "model_type", None) == "gpt_oss" and any(
        is_transposed_experts(m) for m in model.modules())


def check_qconfig(qconfig: Dict[str, Any], path: Path) -> List[str]:
    """The ``modules_to_not_convert`` patterns of a ``quant_method: "mxfp4"`` ``quantization_config``, checked
    (``ValueError`` for other fields, a non-list, a non-string or an invalid regular expression)."""
    where = f"{str(path / CONFIG)!r}: quantization_config"
    extra = sorted(set(qconfig) - set(QCONFIG_FIELDS))
    if extra:
        raise ValueError(f"{where} has fields {extra} that the gpt-oss 'mxfp4' layout does not define (allowed: "
                         f"{', '.join(QCONFIG_FIELDS)})")
    patterns = qconfig.get("modules_to_not_convert") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{where}.modules_to_not_convert={patterns!r} must be a list of module name patterns")
    return checks.check_regexes(f"{where}.modules_to_not_convert pattern", patterns)


def not_converted(name: str, patterns: Sequence[str]) -> bool:
    """Whether module ``name`` is listed by ``modules_to_not_convert`` ``patterns``, with transformers' rules
    (``should_convert_module``): a pattern matches from the start up to a module boundary, as a regular
    expression (``model.layers.*.self_attn``), or as a suffix of the name."""
    return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", name) or name.endswith(p) for p in patterns)


def expert_from_parts(name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: Tuple[int, int],
                      dtype: torch.dtype) -> QuantizedTensor:
    """The ``"mxfp4"`` :class:`QuantizedTensor` of one expert's ``(out, in)`` matrix ``shape`` from its
    ``blocks`` ``uint8 (out, in/32, 16)`` and ``scales`` ``uint8 (out, in/32)`` (no copy: ``codes`` is a view of
    ``blocks``), to dequantize to ``dtype``.

    Raises:
        ValueError: other dtypes or shapes (``in`` must be a multiple of 32), named by ``name``.
    """
    out_features, in_features = shape
    want_blocks, want_scales = (out_features, in_features // GROUP, GROUP // 2), (out_features, in_features // GROUP)
    if in_features % GROUP or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or \
            tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales:
        raise ValueError(f"{name}: the gpt-oss mxfp4 layout stores an ({out_features}, {in_features}) expert matrix as "
                         f"uint8 blocks {want_blocks} and uint8 scales {want_scales} (in a multiple of {GROUP}); got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    qt = QuantizedTensor(codes=blocks.reshape(out_features, in_features // 2), scales=scales,
                         shape=torch.Size(shape), dtype=dtype, fmt="mxfp4", group_size=GROUP, scale_format="e8m0")
    return checked(name, qt, scale_values=False)


def _split_key(key: str) -> Tuple[Optional[str], Optional[str]]:
    for suffix in (BLOCKS, SCALES):
        if key.endswith(suffix):
            return key[:-len(suffix)], suffix
    return None, None


def read(path: Path, hf_config, model_class=None, backend: str = "auto", compute_dtype: Optional[str] = None):
    """The gpt-oss part of :func:`ds_fpquant.load_quantized` (a ``quant_method: "mxfp4"`` checkpoint): each
    ``<p>_blocks`` / ``<p>_scales`` pair becomes the quantized expert stack ``<p>`` (one ``"mxfp4"``
    :class:`QuantizedTensor` per expert, its ``(out, in)`` matrix, the codes and scales as stored), everything
    else is left for the caller to assign as stored. The experts' dequantized weights are bit-identical to
    transformers' ``Mxfp4Config(dequantize=True)`` loading in the same dtype (the checkpoint's ``dtype``).

    Returns:
        ``(model, state, keys)``: the meta-device model with its expert stacks installed, the other tensors by
        checkpoint key, and its :class:`CheckpointKeys` (for ``reader._assign_rest``).

    Raises:
        ValueError: an invalid ``quantization_config``; blocks without scales (or the reverse), for a
            parameter that is not a transposed expert stack or whose module ``modules_to_not_convert``
            lists, or of the wrong dtype or shape; the rest as :func:`ds_fpquant.load_quantized`.
    """
    patterns = check_qconfig(hf_config.quantization_config, path)
    del hf_config.quantization_config  # build the plain model; its experts are replaced below
    dtype = getattr(torch, str(getattr(hf_config, "dtype", None) or "bfloat16").replace("torch.", ""))
    model = meta_model(hf_config, model_class)
    keys = CheckpointKeys(model)
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    state = {}
    for key, tensor in iter_tensors(shard_files(path)):
        base, suffix = _split_key(key)
        target = keys.fused(base) if base is not None else None
        if target is None:
            state[key] = tensor
            continue
        module_name, pname = keys.params[target]
        if not is_transposed_experts(model.get_submodule(module_name)):
            raise ValueError(f"{key}: gpt-oss mxfp4 blocks and scales belong to transposed (E, in, out) experts "
                             f"(GptOssExperts); {module_name} holds (E, out, in) experts")
        if not_converted(module_name, patterns):
            raise ValueError(f"{key}: stored quantized, but quantization_config.modules_to_not_convert lists "
                             f"{module_name} ({patterns})")
        if pairs.setdefault(target, {}).setdefault(suffix, tensor) is not tensor:
            raise ValueError(f"two tensors are {target}{suffix}")
    for target, parts in pairs.items():
        missing = [target + s for s in (BLOCKS, SCALES) if s not in parts]
        if missing:
            raise ValueError(f"{target}: the checkpoint has {sorted(target + s for s in parts)} but not {missing}")
        if target in state or keys.resolve(target, state) is not None:
            raise ValueError(f"{target} is stored both as blocks and scales and in full precision")
        module_name, pname = keys.params[target]
        module = model.get_submodule(module_name)
        n_experts = module._parameters[pname].shape[0]
        blocks, scales = parts[BLOCKS], parts[SCALES]
        if blocks.dim() != 4 or scales.dim() != 3 or blocks.shape[0] != n_experts or scales.shape[0] != n_experts:
            raise ValueError(f"{target}: blocks (E, out, in/32, 16) and scales (E, out, in/32) with E = {n_experts}; "
                             f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
        qts = [expert_from_parts(f"{target}[expert {e}]", blocks[e], scales[e], expert_matrix_shape(module, pname),
                                 dtype) for e in range(n_experts)]
        try:
            install_quantized_experts(module, pname, qts, compute_dtype=compute_dtype, backend=backend)
        except ValueError as exc:
            raise ValueError(f"{target}: {exc}") from None
    return model, state, keys
