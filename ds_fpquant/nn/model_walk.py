"""Walking a model: which modules are linear layers (``nn.Linear``, transformers' ``Conv1D``), which parameters
are mixture-of-experts stacks, and a module's parent."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["is_conv1d", "as_linear", "parent_module", "linear_modules", "expert_parameter_names", "expert_parameters",
           "FUSED_LINEARS", "fused_groups", "shared_scale_groups"]

#: Sibling linears (last name components, under one parent module) that vLLM and SGLang load as one fused layer
#: (their models' ``packed_modules_mapping``: ``qkv_proj``, ``gate_up_proj``, Mixtral-style experts' ``w13``,
#: DeepSeek-V2/V3's ``fused_qkv_a_proj``). A serving engine gives the fused layer one per-tensor scale, the largest
#: of its shards', so NVFP4 weights of such a group must share theirs (SPEC 3.4; NVIDIA ModelOpt's export
#: shares them across the layers that take the same input).
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                 ("q_a_proj", "kv_a_proj_with_mqa"))


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


def fused_groups(names: Iterable[str]) -> List[Tuple[str, ...]]:
    """The groups of :data:`FUSED_LINEARS` among ``names`` (module names): siblings under one parent whose last
    components are in one entry, in the entry's order; only groups of two or more (a lone ``q_proj`` is none)."""
    found: Dict[Tuple[str, int], Dict[int, str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for i, group in enumerate(FUSED_LINEARS):
            if leaf in group:
                found.setdefault((parent, i), {})[group.index(leaf)] = name
    return [tuple(members[j] for j in sorted(members)) for members in found.values() if len(members) > 1]


def shared_scale_groups(names: Iterable[str], settings_for: Callable[[str], Optional[Dict[str, Any]]]) -> List[Tuple[str, ...]]:
    """The :func:`fused_groups` of ``names`` whose weights share one NVFP4 tensor scale: those quantized
    (``settings_for(name)`` not ``None``) to ``fmt="nvfp4"`` with the same settings; a member with other
    settings (an override) or left unquantized keeps its own."""
    groups = []
    for group in fused_groups(names):
        by_settings: Dict[str, List[str]] = {}
        for name in group:
            settings = settings_for(name)
            if settings is not None and settings.get("fmt") == "nvfp4":
                by_settings.setdefault(repr(sorted(settings.items())), []).append(name)
        groups += [tuple(members) for members in by_settings.values() if len(members) > 1]
    return groups
