"""gpt-oss's MXFP4 checkpoint layout, written: :func:`quantize_checkpoint` and :func:`save_quantized` store each
transposed expert stack in the ``"mxfp4"`` preset as ``<p>_blocks`` / ``<p>_scales`` (the layout: :mod:`.read`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ds_fpquant.checkpoint.hf_files import (
    ShardWriter,
    clear_output,
    copy_other_files,
    iter_tensors,
    new_output_dir,
    shard_files,
    write_model_config,
)
from ds_fpquant.checkpoint.keys import CheckpointKeys
from ds_fpquant.checkpoint.layouts.gpt_oss.read import (
    BLOCKS,
    GPT_OSS_METHOD,
    GPT_OSS_NOT_CONVERTED,
    GROUP,
    SCALES,
    is_gpt_oss_model,
)
from ds_fpquant.nn.experts import expert_matrix, is_transposed_experts
from ds_fpquant.nn.quantized_params import quantized_experts
from ds_fpquant.tensor.quantize import quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["expert_to_parts", "writes_gpt_oss", "quantize_checkpoint", "can_save", "save_quantized"]


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
