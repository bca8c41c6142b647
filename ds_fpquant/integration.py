"""DeepSpeed entry points: ``apply`` (model transform), ``init_inference``, ``patch_deepspeed``."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from .config import SECTION, FPQuantizationConfig, _read, load_config
from .experts import expert_parameter_names, quantize_experts_in_place
from .module import COMPUTE_DTYPES, FPQuantizedLinear, is_weight_quantized, quantize_weight_in_place

__all__ = ["apply", "init_inference", "is_quantized_model", "patch_deepspeed", "unpatch_deepspeed"]


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
        from .checkpoint import enable_save_pretrained

        enable_save_pretrained(model)  # save_pretrained writes the quantized checkpoint (save_quantized)
        logger.info(f"ds_fpquant: quantized {replaced} of {len(targets)} linear weights and expert stacks ({config.fmt}, "
                    f"G={config._settings(None)['group_size']}); weights {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB")
    else:
        logger.info(f"ds_fpquant: no Linear module matched ({len(targets)} found)")
    return model


def _tp_size(rest: Dict[str, Any], kwargs: Dict[str, Any]) -> int:
    tp = kwargs.get("tensor_parallel", rest.get("tensor_parallel")) or {}
    size = tp.get("tp_size", 1) if isinstance(tp, dict) else getattr(tp, "tp_size", 1)
    return int(kwargs.get("mp_size", rest.get("mp_size", size)) or 1)


def is_quantized_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds ds_fpquant-quantized weights (linears, AutoTP shards or expert stacks)."""
    return any(isinstance(m, FPQuantizedLinear) or is_weight_quantized(m) or getattr(m, "_fpq_experts", None)
               for m in model.modules())


KERNEL_INJECT_ERROR = ("replace_with_kernel_inject=True cannot run ds_fpquant's quantized weights: DeepSpeed's fused "
                       "inference kernels take the full-precision nn.Linear weights they replace. Use "
                       "replace_with_kernel_inject=False (the default; the quantized layers run ds_fpquant's fused "
                       "linear, with AutoTP through tensor_parallel.tp_size), or leave out the fp_quantization section "
                       "(and a model quantized by apply / load_quantized) to use kernel injection unquantized")


def _check_kernel_inject(model: Optional[torch.nn.Module], quantizing: bool, rest: Dict[str, Any],
                         kwargs: Dict[str, Any]) -> None:
    inject = kwargs.get("replace_with_kernel_inject", rest.get("replace_with_kernel_inject", False))
    if inject and (quantizing or (model is not None and is_quantized_model(model))):
        raise ValueError(KERNEL_INJECT_ERROR)


def _split(config, kwargs: Dict[str, Any]):
    """(the ``fp_quantization`` section or ``None``, the other config keys, the other kwargs): the section may
    come in ``config`` (dict or JSON path) or as the keyword ``fp_quantization=``, not differently in both."""
    data = {} if config is None else dict(_read(config))
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
    section, rest, kwargs = _split(config, kwargs)
    fp_config = load_config({SECTION: section or {}})
    if isinstance(model, (str, os.PathLike)):  # a checkpoint directory: quantized while it is loaded
        _check_kernel_inject(None, fp_config.enabled, rest, kwargs)
        from .loader import load_quantized

        model = load_quantized(model, fp_quantization=fp_config)
        fp_config = None
    return _init_inference(model, fp_config, rest, kwargs)


def _init_inference(model: torch.nn.Module, fp_config: Optional[FPQuantizationConfig], rest: Dict[str, Any],
                    kwargs: Dict[str, Any]):
    """DeepSpeed's ``init_inference`` with ``fp_config`` applied (``None``: none), for full-precision and already
    quantized models, tp 1 and AutoTP."""
    _check_kernel_inject(model, fp_config is not None and fp_config.enabled, rest, kwargs)
    deepspeed_init_inference = _original_init_inference()
    if _tp_size(rest, kwargs) <= 1:
        if fp_config is not None:
            apply(model, fp_config)
        return deepspeed_init_inference(model, config=rest, **kwargs)
    stand_ins = _stand_in_linears(model)  # quantized layers AutoTP can shard, as meta nn.Linear
    keep_on_host = bool(kwargs.get("keep_module_on_host", rest.get("keep_module_on_host", False)))
    if stand_ins:  # the engine moves the module to the device before the stand-ins are replaced: do it after
        (kwargs if "keep_module_on_host" in kwargs or "keep_module_on_host" not in rest else rest)[
            "keep_module_on_host"] = True
    engine = deepspeed_init_inference(model, config=rest, **kwargs)
    _shard_stand_ins(engine.module, stand_ins)
    if stand_ins and not keep_on_host:
        from deepspeed.accelerator import get_accelerator

        engine.module.to(get_accelerator().current_device_name())
    if fp_config is not None:
        apply(engine.module, fp_config)
    return engine


def _stand_in_linears(model: torch.nn.Module) -> Dict[int, FPQuantizedLinear]:
    """Replace each :class:`FPQuantizedLinear` of ``model`` by an ``nn.Linear`` of its shape with a meta
    weight (no memory) and its bias, so that DeepSpeed's AutoTP finds and shards it; returns
    ``id(stand-in weight) -> the quantized layer``. AutoTP keeps the weight's Parameter object when it shards
    it (it sets ``.data``), which is how :func:`_shard_stand_ins` finds each layer's codes again."""
    layers = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, FPQuantizedLinear):
            stand_in = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta",
                                       dtype=module.orig_dtype)
            if module.bias is not None:  # a copy: AutoTP shards the bias it is given in place
                stand_in.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
            stand_in._fpq_quantized = module
            layers[id(stand_in.weight)] = module
            parent, child = _parent(model, name)
            setattr(parent, child, stand_in)
    return layers


def _shard_stand_ins(model: torch.nn.Module, layers: Dict[int, FPQuantizedLinear]) -> None:
    """After AutoTP: each tensor-parallel layer made from a stand-in gets this rank's part of the quantized
    weight (column-parallel ``LinearLayer``: its output rows; row-parallel ``LinearAllreduce``: its input
    columns, whole groups / blocks), and stand-ins AutoTP left alone become the quantized layers again.

    Raises ``ValueError`` naming the layer when its shard cuts a group or block, or AutoTP shards it in a
    way that is not one contiguous range (fused and packed layers)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    from .module import install_quantized_weight
    from .slicing import column_slice, row_slice

    for name, module in list(model.named_modules()):
        source = getattr(module, "_fpq_quantized", None)
        if source is not None:  # not sharded by AutoTP: the quantized layer as it was
            parent, child = _parent(model, name)
            setattr(parent, child, source)
            continue
        weight = getattr(module, "weight", None)
        source = layers.get(id(weight)) if isinstance(weight, torch.nn.Parameter) else None
        if source is None:
            continue
        kind = type(module)
        if kind not in (LinearLayer, LinearAllreduce):
            raise ValueError(f"{name}: AutoTP shards this layer as {kind.__name__}, which is not one contiguous range "
                             f"of the weight; a pre-quantized weight can be sharded for LinearLayer and "
                             f"LinearAllreduce only (quantize after sharding: ds_fpquant.init_inference with the "
                             f"full-precision model)")
        sizes, rank = module._partition_sizes, module.tp_index
        start = sum(sizes[:rank])
        qt = source.quantized_weight
        shard = (row_slice(qt, start, start + sizes[rank], name) if kind is LinearLayer else
                 column_slice(qt, start, start + sizes[rank], name))
        compute_dtype = {v: k for k, v in COMPUTE_DTYPES.items()}.get(source.compute_dtype)
        install_quantized_weight(module, shard, compute_dtype=compute_dtype, backend=source.backend,
                                 activation=source.activation)


def _original_init_inference():
    import deepspeed

    if _PATCHED is not None:
        return _PATCHED[(deepspeed, "init_inference")]
    return deepspeed.init_inference


def _deepspeed_init_inference(model: torch.nn.Module, config=None, **kwargs):
    """``deepspeed.init_inference`` after :func:`patch_deepspeed`: a config (dict or JSON path) or keyword
    with an ``fp_quantization`` section goes through :func:`init_inference`; anything else to DeepSpeed's
    own function unchanged (a quantized model with ``replace_with_kernel_inject=True`` gets the clear
    error instead of an AttributeError from inside DeepSpeed)."""
    section, rest, other = _split(config, kwargs)
    if section is not None:
        return init_inference(model, config, **kwargs)
    if is_quantized_model(model):  # pre-quantized (load_quantized, apply): AutoTP needs the stand-ins
        return _init_inference(model, None, rest, other)
    _check_kernel_inject(model, False, rest, other)
    return _original_init_inference()(model, config, **kwargs)


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
    """Plug ds_fpquant into DeepSpeed's own names (opt-in; undo with :func:`unpatch_deepspeed`).

    - ``deepspeed.init_inference(model, config)`` accepts the ``fp_quantization`` section in its config
      (dict or JSON path) or as ``fp_quantization=`` and applies it as :func:`init_inference` does
      (tp 1 and AutoTP); without the section it is DeepSpeed's function unchanged.
    - DeepSpeed's ``FP_Quantize`` resolves to :class:`ds_fpquant.FP_Quantize`:
      ``deepspeed.linear.QuantizedParameter`` / ``QuantizedLinear`` / ``OptimizedLinear`` built without
      an explicit ``quantizer=`` use this project's quantizer (``copy.deepcopy`` of a
      ``QuantizedParameter`` needs that: DeepSpeed rebuilds it with a default quantizer), and a pickled
      ``QuantizedParameter`` unpickles as one.
    """
    global _PATCHED
    import deepspeed
    import deepspeed.linear.quantization as ds_linear_quant
    import deepspeed.ops.fp_quantizer as ds_fp
    import deepspeed.ops.fp_quantizer.quantize as ds_fp_quantize

    from .fp_quantizer import FP_Quantize

    qp = ds_linear_quant.QuantizedParameter
    if _PATCHED is None:
        _PATCHED = {(m, "FP_Quantize"): m.FP_Quantize for m in (ds_fp, ds_fp_quantize, ds_linear_quant)}
        _PATCHED[(qp, "__reduce_ex__")] = qp.__dict__.get("__reduce_ex__")
        _PATCHED[(deepspeed, "init_inference")] = deepspeed.init_inference
    for module, attr in _PATCHED:
        if attr == "FP_Quantize":
            module.FP_Quantize = FP_Quantize
    qp.__reduce_ex__ = _reduce_quantized_parameter
    deepspeed.init_inference = _deepspeed_init_inference


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
