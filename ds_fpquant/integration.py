"""DeepSpeed entry points: ``apply`` (model transform), ``init_inference``, ``patch_deepspeed``."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .config import FPQuantizationConfig, load_config, split_config
from .experts import expert_parameter_names, quantize_experts_in_place
from .module import FPQuantizedLinear, is_weight_quantized, quantize_weight_in_place

__all__ = ["apply", "init_inference", "patch_deepspeed", "unpatch_deepspeed"]


def is_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D`` (GPT-2's linear layer, weight stored ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def _as_linear(module: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The module as a plain ``nn.Linear`` (itself, or a view of a transformers ``Conv1D``, whose
    weight is stored transposed), or ``None`` for anything else (subclasses included)."""
    if type(module) is torch.nn.Linear:
        return module
    if is_conv1d(module):
        in_features, out_features = module.weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(module.weight.detach().t(), requires_grad=False)
        linear.bias = module.bias
        return linear
    return None


def _is_tensor_parallel_linear(module: torch.nn.Module) -> bool:
    """DeepSpeed AutoTP's sharded linear layers (``LinearLayer``, ``LinearAllreduce``, ...)."""
    try:
        from deepspeed.module_inject.layers import TensorParallel_Layer
    except ImportError:
        return False
    weight = getattr(module, "weight", None)
    return (isinstance(module, TensorParallel_Layer) and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and not is_weight_quantized(module))


def _parent(model: torch.nn.Module, name: str):
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def apply(model: torch.nn.Module, ds_config) -> torch.nn.Module:
    """Replace the matching ``nn.Linear`` modules (and transformers ``Conv1D``, as in GPT-2) of
    ``model`` by :class:`FPQuantizedLinear`, and quantize the weights of DeepSpeed AutoTP's sharded
    linear layers in place (:func:`ds_fpquant.module.quantize_weight_in_place`), in place.

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
    targets = [(name, linear) for name, m in model.named_modules() if (linear := _as_linear(m)) is not None]
    for name, linear in targets:
        settings = config.settings_for(name)
        if settings is None:
            continue
        new = FPQuantizedLinear.from_linear(linear, compute_dtype=config.compute_dtype, backend=config.backend,
                                            activation=config.activation, **settings)
        parent, child = _parent(model, name)
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
        logger.info(f"ds_fpquant: quantized {replaced} of {len(targets)} linear weights and expert stacks ({config.fmt}, "
                    f"G={config._settings(None)['group_size']}); weights {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB")
    else:
        logger.info(f"ds_fpquant: no Linear module matched ({len(targets)} found)")
    return model


def _tp_size(rest: Dict[str, Any], kwargs: Dict[str, Any]) -> int:
    tp = kwargs.get("tensor_parallel", rest.get("tensor_parallel")) or {}
    size = tp.get("tp_size", 1) if isinstance(tp, dict) else getattr(tp, "tp_size", 1)
    return int(kwargs.get("mp_size", rest.get("mp_size", size)) or 1)


def init_inference(model: torch.nn.Module, config=None, **kwargs):
    """``deepspeed.init_inference`` with the ``fp_quantization`` section applied.

    ``config`` (dict or JSON path) holds both the ``fp_quantization`` section and ordinary
    ``init_inference`` keys; ``kwargs`` go to ``deepspeed.init_inference`` as usual. With
    ``tensor_parallel.tp_size == 1`` the model is quantized first; with AutoTP (``tp_size > 1``) the
    engine shards the linears first and the transform is applied to ``engine.module`` after.

    Returns:
        the ``deepspeed.InferenceEngine``.
    """
    import deepspeed

    fp_config, rest = split_config(config)
    if _tp_size(rest, kwargs) <= 1:
        apply(model, fp_config)
        return deepspeed.init_inference(model, config=rest, **kwargs)
    engine = deepspeed.init_inference(model, config=rest, **kwargs)
    apply(engine.module, fp_config)
    return engine


_PATCHED: Optional[Dict[Any, Any]] = None


def _rebuild_quantized_parameter(data, quantization_config, quantizer):
    """Unpickle a ``deepspeed.linear.QuantizedParameter`` as that class (torch's ``Parameter``
    pickling would rebuild a plain ``Parameter``). ``data`` is already quantized, so nothing is
    quantized again."""
    from deepspeed.linear.quantization import QuantizedParameter

    return QuantizedParameter(data, quantization_config=quantization_config, quantizer=quantizer)


def _reduce_quantized_parameter(self, protocol):
    return _rebuild_quantized_parameter, (self.data, self.quantization_config, self.quantizer)


def patch_deepspeed() -> None:
    """Make DeepSpeed's own ``FP_Quantize`` name resolve to :class:`ds_fpquant.FP_Quantize` (opt-in).

    After this, ``deepspeed.linear.QuantizedParameter`` / ``QuantizedLinear`` / ``OptimizedLinear``
    built without an explicit ``quantizer=`` use this project's quantizer (``copy.deepcopy`` of a
    ``QuantizedParameter`` needs that: DeepSpeed rebuilds it with a default quantizer), and a
    pickled ``QuantizedParameter`` unpickles as one. Undo with :func:`unpatch_deepspeed`.
    """
    global _PATCHED
    import deepspeed.linear.quantization as ds_linear_quant
    import deepspeed.ops.fp_quantizer as ds_fp
    import deepspeed.ops.fp_quantizer.quantize as ds_fp_quantize

    from .fp_quantizer import FP_Quantize

    qp = ds_linear_quant.QuantizedParameter
    if _PATCHED is None:
        _PATCHED = {(m, "FP_Quantize"): m.FP_Quantize for m in (ds_fp, ds_fp_quantize, ds_linear_quant)}
        _PATCHED[(qp, "__reduce_ex__")] = qp.__dict__.get("__reduce_ex__")
    for module, attr in _PATCHED:
        if attr == "FP_Quantize":
            module.FP_Quantize = FP_Quantize
    qp.__reduce_ex__ = _reduce_quantized_parameter


def unpatch_deepspeed() -> None:
    """Undo :func:`patch_deepspeed`."""
    global _PATCHED
    if _PATCHED is None:
        return
    for (owner, attr), original in _PATCHED.items():
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _PATCHED = None
