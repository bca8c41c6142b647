"""DeepSpeed AutoTP of quantized models: quantized layers stand in as meta ``nn.Linear`` modules that AutoTP
shards, and each rank's shard gets the codes and scales of its rows or columns, cut as stored (no requantization)."""

from __future__ import annotations

from typing import Dict

import torch

from ds_fpquant.nn.model_walk import parent_module
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import COMPUTE_DTYPES


def stand_in_linears(model: torch.nn.Module) -> Dict[int, FPQuantizedLinear]:
    """Replace each :class:`FPQuantizedLinear` of ``model`` by an ``nn.Linear`` of its shape with a meta
    weight (no memory) and its bias, so that DeepSpeed's AutoTP finds and shards it; returns
    ``id(stand-in weight) -> the quantized layer``. AutoTP keeps the weight's Parameter object when it shards
    it (it sets ``.data``), which is how :func:`shard_stand_ins` finds each layer's codes again."""
    layers = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, FPQuantizedLinear):
            stand_in = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta",
                                       dtype=module.orig_dtype)
            if module.bias is not None:  # a copy: AutoTP shards the bias it is given in place
                stand_in.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
            stand_in._fpq_quantized = module
            layers[id(stand_in.weight)] = module
            parent, child = parent_module(model, name)
            setattr(parent, child, stand_in)
    return layers


def shard_stand_ins(model: torch.nn.Module, layers: Dict[int, FPQuantizedLinear]) -> None:
    """After AutoTP: each tensor-parallel layer made from a stand-in gets this rank's part of the quantized
    weight (column-parallel ``LinearLayer``: its output rows; row-parallel ``LinearAllreduce``: its input
    columns, whole groups / blocks), and stand-ins AutoTP left alone become the quantized layers again.

    Raises ``ValueError`` naming the layer when its shard cuts a group or block, or AutoTP shards it in a
    way that is not one contiguous range (fused and packed layers)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    from ds_fpquant.nn.in_place import install_quantized_weight
    from ds_fpquant.tensor.slicing import column_slice, row_slice

    for name, module in list(model.named_modules()):
        source = getattr(module, "_fpq_quantized", None)
        if source is not None:  # not sharded by AutoTP: the quantized layer as it was
            parent, child = parent_module(model, name)
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
        if getattr(source, "static", False):
            raise ValueError(f"{name}: a static W8A8 layer (FPQuantizedLinear with an input_scale) is not sharded by "
                             f"AutoTP yet; load the checkpoint with load_quantized(path, activation=None), or run at tp=1")
        sizes, rank = module._partition_sizes, module.tp_index
        start = sum(sizes[:rank])
        qt = source.quantized_weight
        shard = (row_slice(qt, start, start + sizes[rank], name) if kind is LinearLayer else
                 column_slice(qt, start, start + sizes[rank], name))
        compute_dtype = {v: k for k, v in COMPUTE_DTYPES.items()}.get(source.compute_dtype)
        install_quantized_weight(module, shard, compute_dtype=compute_dtype, backend=source.backend,
                                 activation=source.activation)
