"""gpt-oss's MXFP4 checkpoint layout (``quant_method: "mxfp4"``, openai/gpt-oss-20b / -120b), read and written.

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

import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ds_fpquant.checkpoint.disk_format import checked
from ds_fpquant.checkpoint.hf_files import (
    CONFIG,
    ShardWriter,
    clear_output,
    copy_other_files,
    iter_tensors,
    meta_model,
    new_output_dir,
    shard_files,
    write_model_config,
)
from ds_fpquant.checkpoint.keys import CheckpointKeys
from ds_fpquant.nn.experts import expert_matrix, expert_matrix_shape, install_quantized_experts, is_transposed_experts
from ds_fpquant.nn.quantized_params import quantized_experts
from ds_fpquant.tensor.quantize import quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["GPT_OSS_METHOD", "GPT_OSS_NOT_CONVERTED", "is_gpt_oss_qconfig", "is_gpt_oss_model", "check_qconfig",
           "expert_from_parts", "expert_to_parts", "not_converted", "read", "writes_gpt_oss", "quantize_checkpoint",
           "save_quantized"]

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
    for p in patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"{where}.modules_to_not_convert has {p!r}, not a valid pattern: {exc}") from None
    return patterns


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


def _is_mxfp4(qt: QuantizedTensor) -> bool:
    return (qt.fmt in ("mxfp4", "e2m1") and qt.group_size == GROUP and qt.scale_format == "e8m0" and qt.block is None
            and qt.grouping == "row" and qt.tensor_scale is None and len(qt.shape) == 2 and qt.shape[1] % GROUP == 0)


def expert_to_parts(name: str, qt: QuantizedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of one expert's ``(out, in)`` matrix in this layout (views of ``qt``'s tensors, on
    the CPU). ``ValueError`` unless ``qt`` is e2m1 in row groups of 32 with E8M0 scales and ``in % 32 == 0``."""
    if not _is_mxfp4(qt):
        raise ValueError(f"{name}: the gpt-oss mxfp4 layout holds e2m1 codes in row groups of {GROUP} with E8M0 scales "
                         f"(the 'mxfp4' preset) of a matrix whose in_features is a multiple of {GROUP}; got fmt="
                         f"{qt.fmt!r}, group_size={qt.group_size}, block={qt.block}, scale_format={qt.scale_format!r}, "
                         f"grouping={qt.grouping!r}, shape={tuple(qt.shape)}")
    out_features, in_features = qt.shape
    return (qt.codes.reshape(out_features, in_features // GROUP, GROUP // 2).cpu(),
            qt.scales.reshape(out_features, in_features // GROUP).cpu())


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


def writes_gpt_oss(hf_config, meta: torch.nn.Module, fmt: str, block, group_size, scale_format) -> bool:
    """Whether :func:`ds_fpquant.quantize_checkpoint` with these settings writes this layout: a gpt-oss model
    and the ``"mxfp4"`` preset as it is (no other ``block``, ``group_size`` or ``scale_format``)."""
    return (fmt == "mxfp4" and block is None and group_size in (None, GROUP) and scale_format in (None, "e8m0")
            and getattr(hf_config, "model_type", None) == "gpt_oss" and is_gpt_oss_model(meta))


def _qconfig(excluded_modules: Sequence[str]) -> Dict[str, Any]:
    return {"quant_method": GPT_OSS_METHOD, "modules_to_not_convert": [*GPT_OSS_NOT_CONVERTED, *excluded_modules]}


def _quantized_modules(keys: CheckpointKeys, meta: torch.nn.Module, selected, label: str) -> List[str]:
    """The experts modules not converted (every expert parameter of theirs unselected), after checking that
    ``selected`` (expert parameter names) takes all or none of each module's parameters (transformers' gpt-oss
    reader decides per module)."""
    by_module: Dict[str, List[bool]] = {}
    for target, (module_name, _) in keys.params.items():
        if is_transposed_experts(meta.get_submodule(module_name)):
            by_module.setdefault(module_name, []).append(target in selected)
    mixed = sorted(m for m, chosen in by_module.items() if any(chosen) and not all(chosen))
    if mixed:
        raise ValueError(f"{label}: the gpt-oss mxfp4 layout converts an experts module whole; these have some "
                         f"expert parameters quantized and some not: {mixed}")
    return sorted(m for m, chosen in by_module.items() if not any(chosen))


def quantize_checkpoint(src: Path, dst: Path, stacks: Dict[str, str], headers, keys: CheckpointKeys,
                        meta: torch.nn.Module, backend: str, max_shard_bytes: int, progress: bool) -> Dict[str, Any]:
    """The gpt-oss part of :func:`ds_fpquant.quantize_checkpoint` (``fmt="mxfp4"`` on a gpt-oss model, checked
    by the caller): every expert stack in ``stacks`` (checkpoint key -> expert parameter, the ones the settings
    select, from :meth:`CheckpointKeys.plan`) is quantized with the ``"mxfp4"`` preset, each
    expert as its ``(out, in)`` matrix, and written as ``<p>_blocks`` / ``<p>_scales``; every other tensor is
    copied as it is (attention, router, embeddings and head are not quantized: gpt-oss's
    ``modules_to_not_convert``). Returns the summary :func:`ds_fpquant.quantize_checkpoint` documents."""
    from tqdm.auto import tqdm

    excluded = _quantized_modules(keys, meta, set(stacks.values()), "quantize_checkpoint")
    device = "cuda" if backend == "cuda" else "cpu"
    files = shard_files(src)
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        writer = ShardWriter(dst, max_shard_bytes)
        bytes_before = bytes_after = 0
        for key, tensor in tqdm(iter_tensors(files), total=len(headers), desc="quantize", unit="tensor",
                                disable=not progress):
            if key not in stacks:
                writer.add(key, tensor)
                continue
            module = meta.get_submodule(keys.params[stacks[key]][0])
            qts = [quantize(expert_matrix(module, tensor, e).to(device), "mxfp4", backend=backend)
                   for e in range(tensor.shape[0])]
            _add_stack(writer, key, qts)
            bytes_before += tensor.numel() * tensor.element_size()
            bytes_after += sum(qt.nbytes for qt in qts)
        shards = writer.close()
        qconfig = _qconfig(excluded)
        skipped = copy_other_files(src, dst, qconfig)
    except BaseException:
        clear_output(dst, created)
        raise
    return {"quantized": len(stacks), "copied": len(headers) - len(stacks), "bytes_before": bytes_before,
            "bytes_after": bytes_after, "shards": shards, "skipped_files": skipped, "kept_partial": [],
            "quantization_config": qconfig}


def _add_stack(writer: ShardWriter, key: str, qts: Sequence[QuantizedTensor]) -> None:
    parts = [expert_to_parts(f"{key}[expert {e}]", qt) for e, qt in enumerate(qts)]
    writer.add(key + BLOCKS, torch.stack([b for b, _ in parts]))
    writer.add(key + SCALES, torch.stack([s for _, s in parts]))


def can_save(model: torch.nn.Module, layers, stacks) -> bool:
    """Whether :func:`ds_fpquant.save_quantized` writes ``model`` in this layout: a gpt-oss model whose only
    quantized parts are transposed expert stacks in the ``"mxfp4"`` preset (``layers``: its quantized linears)."""
    return (not layers and bool(stacks) and is_gpt_oss_model(model)
            and all(_is_mxfp4(qt) for experts in stacks.values() for qt in experts)
            and all(is_transposed_experts(model.get_submodule(name.rpartition(".")[0])) for name in stacks))


def save_quantized(model: torch.nn.Module, directory, *, max_shard_bytes: int) -> Dict[str, Any]:
    """The gpt-oss part of :func:`ds_fpquant.save_quantized` (:func:`can_save` holds): the quantized expert
    stacks as ``<p>_blocks`` / ``<p>_scales`` (their codes and scales as held, nothing quantized again), every
    other state-dict tensor as it is (a tied one once, listed in ``tied``), ``config.json`` with gpt-oss's
    ``quantization_config``. Returns the summary :func:`ds_fpquant.save_quantized` documents."""
    directory = new_output_dir(directory, "directory")
    stacks = {}
    for name, module in model.named_modules():
        for pname, experts in quantized_experts(module).items():
            stacks[f"{name}.{pname}" if name else pname] = (module, pname, experts)
    held = {(id(module), f"{pname}_{part}") for module, pname, _ in stacks.values()
            for part in ("codes", "scales", "tensor_scale")}
    keys = CheckpointKeys(model)
    excluded = _quantized_modules(keys, model, set(stacks), "save_quantized")
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        writer, seen, tied, copied = ShardWriter(directory, max_shard_bytes), {}, {}, 0
        for key, tensor in model.state_dict(keep_vars=True).items():
            owner, _, leaf = key.rpartition(".")
            if (id(model.get_submodule(owner)), leaf) in held:
                continue
            if tensor.numel() and tensor.data_ptr() in seen:
                tied[key] = seen[tensor.data_ptr()]
                continue
            seen[tensor.data_ptr()] = key
            writer.add(key, tensor.detach().cpu())
            copied += 1
        bytes_before = bytes_after = 0
        for name, (_, _, experts) in stacks.items():
            _add_stack(writer, name, experts)
            bytes_before += len(experts) * math.prod(experts[0].shape) * experts[0].dtype.itemsize
            bytes_after += sum(qt.nbytes for qt in experts)
        shards = writer.close()
        qconfig = _qconfig(excluded)
        write_model_config(directory, model, qconfig)
    except BaseException:
        clear_output(directory, created)
        raise
    return {"quantized": len(stacks), "copied": copied, "tied": tied, "bytes_before": bytes_before,
            "bytes_after": bytes_after, "shards": shards, "skipped_files": [], "kept_partial": [],
            "quantization_config": qconfig}
