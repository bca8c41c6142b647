"""Walking a model: which modules are linear layers (``nn.Linear``, transformers' ``Conv1D``), which parameters
are mixture-of-experts stacks, and a module's parent."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["is_conv1d", "as_linear", "parent_module", "linear_modules", "expert_parameter_names", "expert_parameters"]


def is_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D`` (GPT-2's linear layer, weight stored ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def as_linear(module: torch.nn.Module) -> Optional[torch.nn.Linear]:
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


def parent_module(model: torch.nn.Module, name: str):
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def linear_modules(model: torch.nn.Module) -> Dict[str, bool]:
    """Name -> ``True`` for a transformers ``Conv1D`` (weight stored ``(in, out)``), ``False`` for an
    ``nn.Linear``: the modules whose weight can be quantized (as in :func:`ds_fpquant.apply`)."""

    return {name: is_conv1d(m) for name, m in model.named_modules() if type(m) is torch.nn.Linear or is_conv1d(m)}


def expert_parameter_names(module: torch.nn.Module) -> List[str]:
    """The 3-D floating-point parameters of a transformers experts module (class name ending in ``Experts``)."""
    if not type(module).__name__.endswith("Experts"):
        return []
    return [name for name, p in module.named_parameters(recurse=False)
            if p is not None and p.dim() == 3 and p.is_floating_point()]


def expert_parameters(model: torch.nn.Module) -> Dict[str, Tuple[str, str]]:
    """Full name (``model.layers.1.mlp.experts.gate_up_proj``) -> (module name, parameter name) of every
    3-D expert parameter of ``model`` (see :func:`ds_fpquant.nn.model_walk.expert_parameter_names`)."""
    return {f"{name}.{pname}" if name else pname: (name, pname)
            for name, module in model.named_modules() for pname in expert_parameter_names(module)}
