"""DeepSpeed entry points: ``apply`` (the model transform of an ``fp_quantization`` section) and ``init_inference``
(tp 1 and AutoTP)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from ds_fpquant.config import SECTION, FPQuantizationConfig, load_config, read_ds_config
from ds_fpquant.integration.autotp import shard_stand_ins, stand_in_linears
from ds_fpquant.integration.originals import original_init_inference
from ds_fpquant.nn.experts import quantize_experts_in_place
from ds_fpquant.nn.in_place import quantize_weight_in_place
from ds_fpquant.nn.model_walk import as_linear, expert_parameter_names, parent_module, shared_scale_groups
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import is_weight_quantized, quantized_params
from ds_fpquant.tensor.quantize import nvfp4_shared_tensor_scale

__all__ = ["apply", "init_inference", "is_quantized_model"]


def _is_tensor_parallel_linear(module: torch.nn.Module) -> bool:
    """DeepSpeed AutoTP's sharded linear layers (``LinearLayer``, ``LinearAllreduce``, ...)."""
    try:
        from deepspeed.module_inject.layers import TensorParallel_Layer
    except ImportError:
        return False
    weight = getattr(module, "weight", None)
    return (isinstance(module, TensorParallel_Layer) and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and not is_weight_quantized(module))


def apply(model: torch.nn.Module, ds_config) -> torch.nn.Module:
    """Replace the matching ``nn.Linear`` modules (and transformers ``Conv1D``, as in GPT-2) of
    ``model`` by :class:`FPQuantizedLinear`, and quantize the weights of DeepSpeed AutoTP's sharded
    linear layers in place (:func:`ds_fpquant.nn.in_place.quantize_weight_in_place`), in place.

    With NVFP4, the linears that vLLM and SGLang fuse (:data:`ds_fpquant.nn.model_walk.FUSED_LINEARS`: q/k/v,
    gate/up, ...) are quantized with one shared tensor scale, ``t`` of their joint amax (SPEC 3.4); the experts
    of a MoE stack share it per expert (gate and up are one matrix). AutoTP shards keep their own.

    Args:
        model: any ``nn.Module``.
        ds_config: a DeepSpeed config (dict or JSON path) holding an ``"fp_quantization"``
            section, the section alone, or an :class:`FPQuantizationConfig`.

    Returns:
        ``model`` (modified in place). A summary (modules replaced, bytes before / after) goes to
        DeepSpeed's logger.

    Raises:
        TypeError, ValueError: invalid config (the message names the field).
    """
    from deepspeed.utils import logger

    config = load_config(ds_config)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replaced, before, after = 0, 0, 0
    targets = [(name, linear) for name, m in model.named_modules() if (linear := as_linear(m)) is not None]
    # NVFP4: the layers serving engines fuse (q/k/v, gate/up) share one tensor scale (SPEC 3.4)
    weights = dict(targets)
    shared = {name: t for group in shared_scale_groups(weights, config.settings_for)
              for t in [nvfp4_shared_tensor_scale([weights[n].weight for n in group])] for name in group}
    for name, linear in targets:
        settings = config.settings_for(name)
        if settings is None:
            continue
        if name in shared:
            settings = {**settings, "tensor_scale": shared[name]}
        new = FPQuantizedLinear.from_linear(linear, compute_dtype=config.compute_dtype, backend=config.backend,
                                            activation=config.activation, **settings)
        parent, child = parent_module(model, name)
        setattr(parent, child, new)
        replaced += 1
        before += linear.weight.numel() * linear.weight.element_size()
        after += new.nbytes
    sharded = [(name, m) for name, m in model.named_modules() if _is_tensor_parallel_linear(m)]
    for name, layer in sharded:  # AutoTP shards: each rank quantizes its own part of the weight
        settings = config.settings_for(name)
        if settings is None:
            continue
        before += layer.weight.numel() * layer.weight.element_size()
        after += quantize_weight_in_place(layer, compute_dtype=config.compute_dtype, backend=config.backend,
                                          activation=config.activation, **settings)
        replaced += 1
    targets += sharded
    experts = [(f"{name}.{pname}", m, pname) for name, m in model.named_modules() for pname in expert_parameter_names(m)]
    for full_name, module, pname in experts:  # MoE: 3-D (experts, out, in) parameters, each expert on its own
        settings = config.settings_for(full_name)
        if settings is None:
            continue
        b, a = quantize_experts_in_place(module, pname, compute_dtype=config.compute_dtype, backend=config.backend,
                                         activation=config.activation, **settings)
        before, after, replaced = before + b, after + a, replaced + 1
    targets += experts
    if replaced:
        from ds_fpquant.checkpoint.save_hook import enable_save_pretrained

        enable_save_pretrained(model)  # save_pretrained writes the quantized checkpoint (save_quantized)
        logger.info(f"ds_fpquant: quantized {replaced} of {len(targets)} linear weights and expert stacks ({config.fmt}, "
                    f"G={config.settings()['group_size']}); weights {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB")
    else:
        logger.info(f"ds_fpquant: no Linear module matched ({len(targets)} found)")
    return model


def _tp_size(rest: Dict[str, Any], kwargs: Dict[str, Any]) -> int:
    tp = kwargs.get("tensor_parallel", rest.get("tensor_parallel")) or {}
    size = tp.get("tp_size", 1) if isinstance(tp, dict) else getattr(tp, "tp_size", 1)
    return int(kwargs.get("mp_size", rest.get("mp_size", size)) or 1)


def is_quantized_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds ds_fpquant-quantized weights (linears, AutoTP shards or expert stacks)."""
    return any(isinstance(m, FPQuantizedLinear) or bool(quantized_params(m))
               for m in model.modules())


KERNEL_INJECT_ERROR = ("replace_with_kernel_inject=True cannot run ds_fpquant's quantized weights: DeepSpeed's fused "
                       "inference kernels take the full-precision nn.Linear weights they replace. Use "
                       "replace_with_kernel_inject=False (the default; the quantized layers run ds_fpquant's fused "
                       "linear, with AutoTP through tensor_parallel.tp_size), or leave out the fp_quantization section "
                       "(and a model quantized by apply / load_quantized) to use kernel injection unquantized")


def check_kernel_inject(model: Optional[torch.nn.Module], quantizing: bool, rest: Dict[str, Any],
                         kwargs: Dict[str, Any]) -> None:
    inject = kwargs.get("replace_with_kernel_inject", rest.get("replace_with_kernel_inject", False))
    if inject and (quantizing or (model is not None and is_quantized_model(model))):
        raise ValueError(KERNEL_INJECT_ERROR)


def split_fp_section(config, kwargs: Dict[str, Any]):
    """(the ``fp_quantization`` section or ``None``, the other config keys, the other kwargs): the section may
    come in ``config`` (dict or JSON path) or as the keyword ``fp_quantization=``, not differently in both."""
    data = {} if config is None else dict(read_ds_config(config))
    section = data.pop(SECTION, None)
    kwargs = dict(kwargs)
    if SECTION in kwargs:
        given = kwargs.pop(SECTION)
        if section is not None and section != given:
            raise ValueError(f"Conflicting argument {SECTION!r} in 'config': {section} and kwargs: {given}")
        section = given
    return section, data, kwargs


def init_inference(model, config=None, **kwargs):
    """``deepspeed.init_inference`` with the ``fp_quantization`` section applied.

    ``model`` is an ``nn.Module``, or the path of a full-precision Hugging Face checkpoint directory, which
    is quantized while it is loaded (:func:`ds_fpquant.load_quantized` with ``fp_quantization``), so the
    full-precision model is never held.

    ``config`` (dict or JSON path) holds both the ``fp_quantization`` section and ordinary
    ``init_inference`` keys (the section may also be passed as ``fp_quantization=``; without it the
    defaults apply); ``kwargs`` go to ``deepspeed.init_inference`` as usual. With
    ``tensor_parallel.tp_size == 1`` the model is quantized first; with AutoTP (``tp_size > 1``) the
    engine shards the linears first and the transform is applied to ``engine.module`` after. Layers of a
    model quantized before (``load_quantized``, ``apply``) are sharded as stored: each rank gets its output
    rows (``LinearLayer``) or input columns (``LinearAllreduce``) of the codes and scales.

    Returns:
        the ``deepspeed.InferenceEngine``.

    Raises:
        ValueError: an invalid section, or ``replace_with_kernel_inject=True`` (DeepSpeed's fused kernels
            need full-precision weights), before the model is changed; a pre-quantized layer whose AutoTP
            shard would cut a group or block, or that AutoTP splits into several ranges (names the layer).
    """
    section, rest, kwargs = split_fp_section(config, kwargs)
    fp_config = load_config({SECTION: section or {}})
    if isinstance(model, (str, os.PathLike)):  # a checkpoint directory: quantized while it is loaded
        check_kernel_inject(None, fp_config.enabled, rest, kwargs)
        from ds_fpquant.checkpoint.reader import load_quantized

        model = load_quantized(model, fp_quantization=fp_config)
        fp_config = None
    return init_inference_with(model, fp_config, rest, kwargs)


def init_inference_with(model: torch.nn.Module, fp_config: Optional[FPQuantizationConfig], rest: Dict[str, Any],
                    kwargs: Dict[str, Any]):
    """DeepSpeed's ``init_inference`` with ``fp_config`` applied (``None``: none), for full-precision and already
    quantized models, tp 1 and AutoTP."""
    check_kernel_inject(model, fp_config is not None and fp_config.enabled, rest, kwargs)
    deepspeed_init_inference = original_init_inference()
    if _tp_size(rest, kwargs) <= 1:
        if fp_config is not None:
            apply(model, fp_config)
        return deepspeed_init_inference(model, config=rest, **kwargs)
    stand_ins = stand_in_linears(model)  # quantized layers AutoTP can shard, as meta nn.Linear
    keep_on_host = bool(kwargs.get("keep_module_on_host", rest.get("keep_module_on_host", False)))
    if stand_ins:  # the engine moves the module to the device before the stand-ins are replaced: do it after
        (kwargs if "keep_module_on_host" in kwargs or "keep_module_on_host" not in rest else rest)[
            "keep_module_on_host"] = True
    engine = deepspeed_init_inference(model, config=rest, **kwargs)
    shard_stand_ins(engine.module, stand_ins)
    if stand_ins and not keep_on_host:
        from deepspeed.accelerator import get_accelerator

        engine.module.to(get_accelerator().current_device_name())
    if fp_config is not None:
        apply(engine.module, fp_config)
    return engine
