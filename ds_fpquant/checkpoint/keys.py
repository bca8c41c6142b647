"""Checkpoint keys -> the model's names: which file tensor is which module's weight, and which holds
which expert's matrix.

A checkpoint may name a tensor differently from the model built from it: with or without the base-model
prefix (``bert.``, ``model.``), under the names the model was released with (Mixtral's
``block_sparse_moe`` is ``mlp`` in transformers 5), and, for mixture-of-experts layers, one matrix per
expert where the model has one 3-D parameter.

transformers 5 holds a MoE layer's experts as 3-D parameters ``(E, out, in)`` (``experts.gate_up_proj``,
``experts.down_proj``); checkpoints keep one 2-D matrix per expert and projection, under the keys the
model was released with: ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` (DeepSeek-V3,
Qwen-MoE) or ``block_sparse_moe.experts.{e}.w1.weight`` / ``w3`` / ``w2`` (Mixtral). transformers' own
conversion mapping (``transformers.conversion_mapping``) says how the keys become the parameter:
``MergeModulelist(dim=0)`` stacks the experts and ``Concatenate(dim=1)`` joins gate and up along ``out``.
:class:`CheckpointKeys` reads that mapping, so every model transformers can load is covered, and inverts only
those two operations; a checkpoint whose experts use other operations is not treated as experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ds_fpquant.nn.model_walk import expert_parameters

__all__ = ["check_expert_slots", "CheckpointKeys", "ExpertPart", "QuantizationPlan", "check_patterns"]

#: safetensors dtypes of the weights that can be quantized (fp32 / fp16 / bf16, SPEC 2).
QUANTIZABLE_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class ExpertPart:
    """Where a checkpoint matrix goes: rows of expert ``expert`` of the 3-D parameter ``target``, as
    part ``part`` of ``parts`` concatenated along ``out`` (gate is 0 and up is 1 of 2; down is 0 of 1)."""

    target: str
    expert: int
    part: int
    parts: int


def _op_signature(converter) -> Optional[Tuple[str, ...]]:
    ops = tuple(f"{type(op).__name__}({getattr(op, 'dim', None)})" for op in getattr(converter, "operations", ()))
    return ops if ops in (("MergeModulelist(0)",), ("MergeModulelist(0)", "Concatenate(1)")) else None


@dataclass
class QuantizationPlan:
    """Which checkpoint tensors a quantizing pass quantizes (:meth:`CheckpointKeys.plan`)."""

    weights: Dict[str, str]  # linear module -> the checkpoint key of its weight (all linears in the files)
    linears: Dict[str, str]  # checkpoint key -> linear module, for the weights the settings select
    experts: Dict[str, ExpertPart]  # checkpoint key -> the expert matrix it is, selected
    stacks: Dict[str, str]  # checkpoint key of a stored (E, out, in) stack -> expert parameter, selected


def check_patterns(patterns, names, label: str) -> None:
    """Raise ``ValueError`` for the regular expressions in ``patterns`` that match (``re.search``) none of
    ``names`` (linear modules and expert parameters): a pattern that matches nothing changes nothing."""
    names = list(names)
    unmatched = [p for p in patterns if not any(re.search(p, name) for name in names)]
    if unmatched:
        raise ValueError(f"{label} {unmatched} match none of the {len(names)} linear modules and expert parameters "
                         f"(e.g. {', '.join(names[:3])}); nothing would change for them")


def check_expert_slots(target: str, shape: Tuple[int, ...], slots: Dict[Tuple[int, int], Any], n_parts: int) -> None:
    """Raise ``ValueError`` unless the checkpoint's per-expert matrices ``slots`` (``(expert, part) -> what names
    it``) fill the ``(E, out, in)`` expert parameter ``target``: every expert ``0 .. E-1`` with every part, none
    beyond. The one fill check of the writer and the reader."""
    n_experts = shape[0]
    missing = [f"expert {e} part {p}" for e in range(n_experts) for p in range(n_parts) if (e, p) not in slots]
    extra = [slots[slot] for slot in sorted(slots) if slot[0] >= n_experts]
    if missing or extra:
        raise ValueError(f"{target} {tuple(shape)}: the checkpoint's per-expert matrices do not fill it; missing: "
                         f"{missing}, beyond its {n_experts} experts: {extra}")


class CheckpointKeys:
    """Maps checkpoint keys onto the names of ``model``: modules, expert parameters and their parts.

    Args:
        model: the transformers model (the meta-device one is enough); its conversion mapping is read
            with ``transformers.conversion_mapping.get_model_conversion_mapping``.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = expert_parameters(model)
        self.prefix = getattr(model, "base_model_prefix", "")
        self.renamings: List = []
        self.converters: List = []
        self.legacy_renamings: List = []
        self.other_converters: List = []
        if not hasattr(model, "config"):
            return
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model, add_legacy=False)
        for transform in transforms:
            if isinstance(transform, WeightRenaming):
                self.renamings.append(transform)
            elif isinstance(transform, WeightConverter) and _op_signature(transform) is not None:
                self.converters.append(transform)
        # for check_fits only: what transformers also applies when it loads (the legacy renamings such as
        # LayerNorm.gamma -> .weight, which add_legacy=True appends), and the converters not modelled here
        everything = [*transforms, *(get_checkpoint_conversion_mapping("legacy") or [])]
        self.legacy_renamings = [t for t in everything if isinstance(t, WeightRenaming)]
        self.other_converters = [t for t in everything if isinstance(t, WeightConverter)
                                 and _op_signature(t) is None]

    def rename(self, key: str) -> str:
        """``key`` with transformers' renamings for this model applied (``block_sparse_moe`` -> ``mlp``)."""
        if not self.renamings:
            return key
        from transformers.core_model_loading import apply_renamings

        return apply_renamings(key, self.renamings)

    def resolve(self, name: str, names) -> Optional[str]:
        """Checkpoint name ``name`` as a member of ``names`` (the model's module or tensor names), allowing
        the base-model prefix on either side and the renamings; ``None`` if it is not one."""
        p = self.prefix
        for base in dict.fromkeys((name, self.rename(name))):
            for candidate in (base, base[len(p) + 1:] if p and base.startswith(p + ".") else None,
                              f"{p}.{base}" if p else None):
                if candidate is not None and candidate in names:
                    return candidate
        return None

    def module(self, key: str, suffix: str, modules: Dict[str, Any]) -> Optional[str]:
        """The member of ``modules`` whose tensor ``<module><suffix>`` checkpoint ``key`` is, else ``None``."""
        return self.resolve(key[:-len(suffix)], modules) if key.endswith(suffix) else None

    def shape(self, target: str) -> Tuple[int, ...]:
        """The ``(E, out, in)`` shape of expert parameter ``target`` in the model."""
        module, pname = self.params[target]
        return tuple(self.model.get_submodule(module)._parameters[pname].shape)

    def check_parts(self, parts: Dict[str, ExpertPart], shapes: Dict[str, Tuple[int, ...]]) -> None:
        """Raise ``ValueError`` unless the checkpoint matrices ``parts`` (key -> :class:`ExpertPart`, with
        their ``shapes``) fill each expert parameter exactly: 2-D, one matrix per expert and part, every
        expert and part there, rows adding up to ``out`` and ``in`` columns."""
        slots: Dict[str, Dict[Tuple[int, int], str]] = {}
        for key, part in parts.items():
            if len(shapes[key]) != 2:
                raise ValueError(f"{key}: an expert's matrix is 2-D, got shape {tuple(shapes[key])}")
            taken = slots.setdefault(part.target, {})
            other = taken.setdefault((part.expert, part.part), key)
            if other != key:
                raise ValueError(f"{other} and {key} are both part {part.part} of expert {part.expert} of "
                                 f"{part.target}")
        for target, taken in slots.items():
            n_experts, out_features, in_features = self.shape(target)
            n_parts = parts[next(iter(taken.values()))].parts
            check_expert_slots(target, (n_experts, out_features, in_features), taken, n_parts)
            for e in range(n_experts):
                matrices = [taken[(e, p)] for p in range(n_parts)]
                rows = sum(shapes[k][0] for k in matrices)
                if rows != out_features or any(shapes[k][1] != in_features for k in matrices):
                    raise ValueError(f"{target}: expert {e}'s matrices {[(k, tuple(shapes[k])) for k in matrices]} do "
                                     f"not make the ({out_features}, {in_features}) matrix the model needs")

    def check_fits(self, headers: Dict[str, Tuple[str, Tuple[int, ...]]]) -> None:
        """Raise ``ValueError`` unless the checkpoint (``headers``: key -> (safetensors dtype, shape)) holds every
        parameter of the model (a tied one once): under its name (the base-model prefix and transformers'
        renamings, legacy ones included, allowed) with the model's shape, or for an expert stack as per-expert
        matrices. Parameters the model declares optional (``_keys_to_ignore_on_load_missing``) may be absent,
        and when transformers would convert some of the checkpoint's tensors in ways not modelled here (a
        fused qkv split, a transpose), only the shapes of the tensors found by name are checked. What a writer
        checks before writing anything.
        """
        from transformers.core_model_loading import apply_renamings

        params = dict(self.model.named_parameters())  # tied parameters once
        found, wrong, parts = set(), {}, set()
        for key, (_, shape) in headers.items():
            name = self.resolve(key, params)
            if name is None and self.legacy_renamings:
                name = self.resolve(apply_renamings(key, self.legacy_renamings), params)
            if name is not None:
                found.add(name)
                if tuple(shape) != tuple(params[name].shape):
                    wrong[key] = (tuple(shape), tuple(params[name].shape))
            elif key.endswith(".weight") and (part := self.part(key)) is not None:
                parts.add(part.target)
        optional = [re.compile(p) for p in getattr(self.model, "_keys_to_ignore_on_load_missing", None) or []]
        converted = any(c.rename_source_key(key)[1] is not None for c in self.other_converters for key in headers)
        # a model not tied yet (transformers' from_pretrained ties after loading) lists a tied parameter twice
        tied = {name for name, source in (getattr(self.model, "all_tied_weights_keys", None) or {}).items()
                if source in found}
        missing = [] if converted else [name for name in params if name not in found and name not in parts
                                        and name not in tied and not any(p.search(name) for p in optional)]
        if missing or wrong:
            model = type(self.model).__name__
            raise ValueError(f"the checkpoint's tensors do not fit {model} as its config.json builds it: "
                             + "; ".join(filter(None, [
                                 f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}" if missing else "",
                                 f"other shapes (stored, model) {wrong}" if wrong else ""]))
                             + (" (is it stored in another quantized format, without its quantization_config?)"
                                if missing else ""))

    def plan(self, headers: Dict[str, Tuple[str, Tuple[int, ...]]], linears: Dict[str, Any],
             settings_for) -> QuantizationPlan:
        """The tensors of a checkpoint (``headers``: key -> (safetensors dtype, shape)) that a pass quantizes:
        the weights of ``linears`` and the expert matrices and stacks for which ``settings_for(name)`` is not
        ``None``.

        Raises:
            ValueError: two keys for one weight, per-expert matrices that do not fill their parameter, a
                stack of the wrong shape, or a selected weight that is not fp32 / fp16 / bf16.
        """
        weights: Dict[str, str] = {}
        for key in headers:
            name = self.module(key, ".weight", linears)
            if name is not None and weights.setdefault(name, key) != key:
                raise ValueError(f"{weights[name]} and {key} are both the weight of {name}")
        selected = {key: name for name, key in weights.items() if settings_for(name) is not None}
        experts = {key: part for key in headers if key not in selected and (part := self.part(key)) is not None
                   and settings_for(part.target) is not None}
        stacks = {key: target for key in headers if (target := self.fused(key)) is not None
                  and settings_for(target) is not None}
        self.check_parts(experts, {key: headers[key][1] for key in experts})
        bad_stacks = {key: headers[key][1] for key, target in stacks.items() if headers[key][1] != self.shape(target)}
        if bad_stacks:
            raise ValueError(f"these expert stacks do not have the (experts, out, in) shape of the model's parameter: "
                             f"{bad_stacks}")
        bad = {key: headers[key][0] for key in [*selected, *experts, *stacks] if headers[key][0] not in QUANTIZABLE_DTYPES}
        if bad:
            raise ValueError(f"these linear weights cannot be quantized (dtypes {', '.join(QUANTIZABLE_DTYPES)} only): "
                             f"{bad}; exclude them with exclude=[...]")
        return QuantizationPlan(weights, selected, experts, stacks)

    def fused(self, key: str) -> Optional[str]:
        """The expert parameter stored whole (3-D) under checkpoint ``key``, else ``None``."""
        return self.resolve(key, self.params) if self.params else None

    def part(self, weight_key: str) -> Optional[ExpertPart]:
        """The :class:`ExpertPart` of a per-expert checkpoint matrix ``weight_key`` (ending in ``.weight``),
        or ``None`` when it is no expert's."""
        if not self.converters or not self.params:
            return None
        renamed = self.rename(weight_key)
        for converter in self.converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is None:
                continue
            target = self.resolve(target, self.params)
            expert = re.search(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)") + "$", renamed)
            if target is None or expert is None:
                return None
            return ExpertPart(target, int(expert.group(1)), converter.source_patterns.index(pattern),
                              len(converter.source_patterns))
        return None

    def unfuse(self, key: str, shape: Tuple[int, ...]) -> Optional[Dict[str, Tuple[ExpertPart, int]]]:
        """For an expert stack stored whole under ``key`` (``shape`` ``(E, out, in)``): the per-expert keys
        the model is released with (transformers' reverse conversion, as ``save_pretrained`` writes
        them), each with its :class:`ExpertPart` and row count; ``None`` when the model has no such
        mapping (the stack is then stored as it is)."""
        target = self.fused(key)
        if target is None or not self.converters:
            return None
        from transformers.core_model_loading import revert_weight_conversion

        try:
            split = revert_weight_conversion(self.model, {key: torch.empty(shape, device="meta")})
        except (ValueError, RuntimeError, KeyError):
            return None
        out = {}
        for name, tensor in split.items():
            part = self.part(name)
            if part is None or part.target != target or tensor.dim() != 2 or tensor.shape[1] != shape[2]:
                return None
            out[name] = (part, tensor.shape[0])
        covered = {(p.expert, p.part) for p, _ in out.values()}
        parts = next(iter(out.values()))[0].parts if out else 0
        if covered != {(e, i) for e in range(shape[0]) for i in range(parts)} or \
                sum(rows for p, rows in out.values() if p.expert == 0) != shape[1]:
            return None
        return out
