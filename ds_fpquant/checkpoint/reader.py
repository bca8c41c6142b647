"""``ds_fpquant.load_quantized``: a quantized checkpoint (any layout of :mod:`ds_fpquant.checkpoint.layouts`) back into
its transformers model, linears as :class:`~ds_fpquant.nn.quantized_linear.FPQuantizedLinear` and mixture-of-experts
parameters as quantized expert stacks, holding the codes and scales as stored: the module tree is built on
the meta device and every tensor is assigned from the file, so no full-precision copy of a quantized weight
is made.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ds_fpquant.checkpoint import layouts
from ds_fpquant.checkpoint.hf_files import iter_tensors, meta_model, model_dir, read_config, shard_files, tensor_headers
from ds_fpquant.checkpoint.keys import CheckpointKeys, check_expert_slots, check_patterns
from ds_fpquant.checkpoint.layouts.gpt_oss import read as gpt_oss_read
from ds_fpquant.checkpoint.save_hook import enable_save_pretrained
from ds_fpquant.nn.experts import expert_matrix, expert_matrix_shape, install_quantized_experts
from ds_fpquant.nn.model_walk import fused_groups, linear_modules, shared_scale_groups
from ds_fpquant.tensor.quantize import nvfp4_shared_tensor_scale, quantize
from ds_fpquant.tensor.slicing import join_rows, nvfp4_beside_e2m1

__all__ = ["load_quantized", "CHECKPOINT_ACTIVATION", "QuantizedCheckpoint", "plan_quantized", "read_quantized"]

#: ``load_quantized(activation=...)``'s default: activations as the checkpoint says (static per-tensor FP8 input
#: scales applied); ``None``: weight-only.
CHECKPOINT_ACTIVATION = "checkpoint"


def load_quantized(path, *, fp_quantization=None, model_class=None, backend: str = "auto",
                   compute_dtype: Optional[str] = None, activation: Optional[str] = CHECKPOINT_ACTIVATION):
    """Build a quantized transformers model from a checkpoint directory, with
    :class:`~ds_fpquant.nn.quantized_linear.FPQuantizedLinear` layers and quantized expert stacks: no full-precision copy of
    the model is ever held (the module tree is built on the meta device and every tensor is assigned as it
    is read).

    - A quantized checkpoint (``fp_quantization=None``): the codes and scales as stored, in either layout of
      :func:`~ds_fpquant.quantize_checkpoint`, and the layouts of other tools registered in
      :mod:`ds_fpquant.checkpoint.layouts`: block FP8 (``quant_method: "fp8"`` with ``weight_block_size``,
      DeepSeek-V3 style), per-tensor FP8 (``"fp8"`` without it, AutoFP8), compressed-tensors
      (``"compressed-tensors"``: FP8 per tensor / channel / block / group, NVFP4, MXFP4, MXFP8), bit-identical
      to those tools' dequantization (``docs/checkpoints.md``). Static activation scales are recorded in
      ``model.ds_fpquant_activation_scales`` (as stored). Where the checkpoint says a linear's activations are
      statically quantized per tensor in FP8 (compressed-tensors ``input_activations`` ``{type: float,
      num_bits: 8, strategy: tensor, dynamic: false}``, ModelOpt ``FP8``, ``activation_scheme: "static"``), the
      layer runs static W8A8 with its ``input_scale`` (SPEC 8.3), the largest of its fused group's (q/k/v,
      gate/up) as vLLM takes it (:class:`~ds_fpquant.checkpoint.layouts.UnsharedInputScalesWarning` when they
      differ). Quantized expert stacks stored per expert (``mlp.experts.{e}.gate_proj.input_scale`` ...) run static
      W8A8 too, with one scale per stack: the largest over its experts (and over gate and up), as vLLM's FP8 MoE
      layer takes it (:class:`~ds_fpquant.checkpoint.layouts.UnsharedInputScalesWarning` when they differ). Other
      static scales (NVFP4's: FP4 activations) are not applied
      (:class:`~ds_fpquant.checkpoint.layouts.StaticActivationScalesWarning`, once).
    - A full-precision checkpoint with ``fp_quantization`` settings: quantize while loading. Each tensor is
      read once; a linear or expert weight the settings select is quantized as it is read, everything else
      assigned as read. The result is bit-identical to :func:`ds_fpquant.apply` on the model
      ``from_pretrained`` loads, with the same settings (same module patterns, excludes and defaults).

    Args:
        path: the checkpoint directory (``config.json``; with ``quantization_config`` unless
            ``fp_quantization`` is given).
        fp_quantization: the ``fp_quantization`` section (dict), a DeepSpeed config (dict or JSON path)
            holding it, or an :class:`~ds_fpquant.config.FPQuantizationConfig`; ``None`` for a quantized
            checkpoint. Its ``backend``, ``compute_dtype`` and ``activation`` apply to the layers.
        model_class: the transformers class to build; default: ``config.architectures[0]``.
        backend, compute_dtype: as for :class:`~ds_fpquant.nn.quantized_linear.FPQuantizedLinear` (quantized
            checkpoints; with ``fp_quantization`` the section's own apply).
        activation: quantized checkpoints: ``"checkpoint"`` (default: static per-tensor FP8 input scales applied
            where the checkpoint says so) or ``None`` (every layer weight-only; the scales still recorded).
            With ``fp_quantization`` the section's own ``activation`` applies.

    Returns:
        the model on the CPU in eval mode (move it with ``.to(device)``).

    Raises:
        ValueError, TypeError: not a model directory; no or an invalid ``quantization_config`` (quantized
            checkpoints), or a quantized checkpoint given ``fp_quantization``, or ``exclude`` / ``modules``
            patterns that match no linear module or expert parameter; tensors that are missing, damaged or
            do not fit the model (the message names the module).
    """
    from ds_fpquant.numerics import checks

    if activation is not None:
        checks.check_choice("activation", activation, (CHECKPOINT_ACTIVATION,))
    path = model_dir(path, "path")
    hf_config = read_config(path)
    if fp_quantization is not None:
        return _quantize_while_loading(path, hf_config, fp_quantization, model_class)
    if gpt_oss_read.is_gpt_oss_qconfig(getattr(hf_config, "quantization_config", None)):  # its own module
        model, state, keys = gpt_oss_read.read(path, hf_config, model_class, backend, compute_dtype)
        _assign_rest(model, state, keys)
        enable_save_pretrained(model)
        return model.eval()
    reading = layouts.reading_for(layouts.find_qconfig(hf_config, path), path)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # build the plain model; its linears are replaced below
    model = meta_model(hf_config, model_class)
    plan = plan_quantized(model, path, reading, hf_config)
    state = read_quantized(model, plan, backend, compute_dtype, activation)
    _assign_rest(model, state, plan.keys)
    enable_save_pretrained(model)
    return model.eval()


@dataclass
class QuantizedCheckpoint:
    """What :func:`read_quantized` reads from a quantized checkpoint into a model on the meta device, from the
    headers only (:func:`plan_quantized`): the layout's :class:`~ds_fpquant.checkpoint.layouts.Reading`, the dtype
    of the weights, the shards, every tensor's (dtype, shape), the model's linears and keys, and the linear modules
    stored quantized."""

    reading: Any
    dtype: torch.dtype
    files: List[Any]
    headers: Dict[str, Tuple[str, Tuple[int, ...]]]
    linears: Dict[str, bool]
    keys: CheckpointKeys
    quantized: Set[str]

    def owned(self) -> Set[str]:
        """The checkpoint keys :func:`read_quantized` installs: the tensors of the quantized linears (their biases
        too) and of quantized expert matrices and stacks; the rest is the model's plain state."""
        owned = {key for key in self.headers
                 if _place(key, self.quantized, self.linears, self.keys, self.reading)[0] is not None}
        return owned | {key for key in self.headers if self.keys.module(key, ".bias", self.linears) in self.quantized}

    def expert_targets(self) -> Set[str]:
        """The expert parameters (``model.layers.1.mlp.experts.gate_up_proj``) the checkpoint stores per expert or
        as a stack in the layout's keys: :func:`read_quantized` installs them."""
        targets = set()
        for key in self.headers:
            kind, where, _ = _place(key, self.quantized, self.linears, self.keys, self.reading)
            if kind == "expert":
                targets.add(where.target)
            elif kind == "stack":
                targets.add(where)
        return targets


def plan_quantized(model: torch.nn.Module, path, reading, hf_config) -> QuantizedCheckpoint:
    """The :class:`QuantizedCheckpoint` of the checkpoint directory ``path`` (layout ``reading``) for ``model``
    (its module tree on the meta device, built from ``hf_config``), from the safetensors headers.

    Raises ``ValueError`` for quantized weights of modules the checkpoint's ``quantization_config`` lists as not
    converted, or shards that are not readable safetensors."""
    own = reading.own
    dtype = getattr(torch, own.get("weight_dtype") or str(getattr(hf_config, "dtype", None) or "bfloat16").replace(
        "torch.", ""))
    linears, keys = linear_modules(model), CheckpointKeys(model)
    files = shard_files(path)
    headers = tensor_headers(files)
    quantized = {name for key in headers for suffix in reading.suffixes if suffix != ".weight"
                 and (name := keys.module(key, suffix, linears)) is not None}
    quantized |= {name for key, (dtype_name, _) in headers.items() if dtype_name in reading.code_dtypes
                  and (name := keys.module(key, ".weight", linears)) is not None}
    ignored = sorted(name for name in quantized if reading.ignored(name))
    if ignored:
        raise ValueError(f"{ignored} are stored quantized but the checkpoint's quantization_config lists them as not "
                         f"converted ({list(reading.ignore)})")
    return QuantizedCheckpoint(reading, dtype, files, headers, linears, keys, quantized)


def read_quantized(model: torch.nn.Module, plan: QuantizedCheckpoint, backend: str = "auto",
                   compute_dtype: Optional[str] = None, activation: Optional[str] = CHECKPOINT_ACTIVATION,
                   only: Optional[Set[str]] = None) -> Dict[str, torch.Tensor]:
    """Read the checkpoint of ``plan`` one tensor at a time into ``model`` (on the meta device): its quantized
    linears become :class:`~ds_fpquant.nn.quantized_linear.FPQuantizedLinear` and its quantized expert parameters
    quantized expert stacks, holding the codes and scales as stored (:func:`load_quantized`'s arguments).
    ``only``: read just these keys (``plan.owned()``: what a loader that assigns the rest itself leaves to this).

    Returns the tensors read that are not quantized weights (name -> tensor, as stored)."""
    reading, dtype, linears, keys, quantized = plan.reading, plan.dtype, plan.linears, plan.keys, plan.quantized
    own = reading.own
    files = plan.files
    from ds_fpquant.nn.model_walk import parent_module
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    skip = () if only is None else set(plan.headers) - set(only)
    parts: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name in quantized}
    expert_parts: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}  # target -> (e, part) -> tensors
    fused: Dict[str, Dict[str, torch.Tensor]] = {}  # target -> tensors of a stored (E, ...) stack
    state = {}
    placed: Dict[Tuple, str] = {}  # where each tensor went -> its key: two keys for one place are an error
    activation_scales: Dict[str, Dict[str, torch.Tensor]] = {}  # recorded (applied where static_input says so)
    expert_inputs: Dict[str, Dict[Tuple[int, int], Tuple]] = {}  # target -> (e, part) -> (module, owner, input_scale)
    for key, tensor in iter_tensors(files, skip):
        kind, where, part_name = _place(key, quantized, linears, keys, reading)
        slot = (kind, where, part_name) if kind else None
        if slot is not None and placed.setdefault(slot, key) != key:
            raise ValueError(f"{placed[slot]} and {key} are both {part_name} of {getattr(where, 'target', where)}"
                             f"{f' expert {where.expert} part {where.part}' if kind == 'expert' else ''}")
        if kind is not None and part_name in reading.activation_parts:
            owner = where if kind == "linear" else (f"{where.target}[expert {where.expert}, part {where.part}]"
                                                    if kind == "expert" else where)
            activation_scales.setdefault(owner, {})[part_name] = tensor
            if kind == "expert" and part_name == "input_scale":  # the per-expert module, as the checkpoint names it
                expert_inputs.setdefault(where.target, {})[(where.expert, where.part)] = (
                    key[:-len(".input_scale")], owner, tensor)
        elif kind == "linear":
            parts[where][part_name] = tensor
        elif kind == "expert":
            expert_parts.setdefault(where.target, {}).setdefault((where.expert, where.part), {})[part_name] = tensor
        elif kind == "stack":
            fused.setdefault(where, {})[part_name] = tensor
        else:
            state[key] = tensor
    twice = sorted(set(expert_parts) & set(fused))
    if twice:
        raise ValueError(f"these expert parameters are stored both per expert and as a stack: {twice}")
    biases = {keys.module(key, ".bias", linears): key for key in state}
    transposed = set(own.get("transposed", ()))
    static = _static_input_scales(parts, activation_scales, reading) if activation == CHECKPOINT_ACTIVATION else {}
    for name, tensors in parts.items():
        module = model.get_submodule(name)
        if linears[name] and name not in transposed:
            raise ValueError(f"{name} is a Conv1D whose quantized weight is not stored as (out, in); "
                             f"only checkpoints listing it in quantization_config.ds_fpquant.transposed are supported")
        shape = tuple(module.weight.shape[::-1]) if linears[name] else tuple(module.weight.shape)
        qt = reading.from_parts(name, tensors, shape, dtype)
        bias = state.pop(biases[name]) if name in biases else None
        if (bias is None) != (module.bias is None):
            raise ValueError(f"{name}: the model {'has' if module.bias is not None else 'has no'} bias, the "
                             f"checkpoint {'has none' if bias is None else 'has one'}")
        if bias is not None and tuple(bias.shape) != (shape[0],):
            raise ValueError(f"{name}.bias has shape {tuple(bias.shape)}; expected ({shape[0]},)")
        parent, child = parent_module(model, name)
        try:
            layer = FPQuantizedLinear(qt, bias, compute_dtype=compute_dtype, backend=backend,
                                      activation="e4m3" if name in static else None, input_scale=static.get(name))
        except ValueError as exc:  # a static input scale with a weight the static W8A8 path does not take
            raise ValueError(f"{name}: {exc}; load_quantized(path, activation=None) loads it weight-only") from None
        setattr(parent, child, layer)
    expert_static = ({target: _expert_input_scale(target, by_part, expert_inputs.get(target, {}), reading)
                      for target, by_part in expert_parts.items()} if activation == CHECKPOINT_ACTIVATION else {})
    quantized_stacks = {target for target, by_part in expert_parts.items()
                        if _load_expert_parts(model, keys, target, by_part, reading, dtype, state, backend,
                                              compute_dtype, expert_static.get(target))}
    # per-expert static FP8 input scales that the quantized stacks apply (activation=None opts out, unwarned)
    applied = {owner for target in quantized_stacks for module_name, owner, _ in expert_inputs.get(target, {}).values()
               if reading.static_input(module_name)}
    for target, tensors in fused.items():
        _load_fused_experts(model, keys, target, tensors, reading, dtype, state, backend, compute_dtype)
    if activation_scales:
        model.ds_fpquant_activation_scales = activation_scales
    # what the checkpoint quantizes statically and ds_fpquant does not apply (activation=None opts out of the rest)
    unapplied = {owner: scales for owner, scales in activation_scales.items()
                 if not (owner in parts and set(scales) == {"input_scale"} and reading.static_input(owner))
                 and not (owner in applied and set(scales) == {"input_scale"})}
    if unapplied:
        warnings.warn(layouts.StaticActivationScalesWarning(
            f"the checkpoint stores static activation scales ({', '.join(sorted({p for a in unapplied.values() for p in a}))}) "
            f"for {len(unapplied)} weights that ds_fpquant does not apply (it applies static per-tensor FP8 input "
            f"scales only; not FP4 activations, nor experts stored as a whole stack): those layers run weight-only. They are "
            f"kept in model.ds_fpquant_activation_scales"), stacklevel=3)
    return state




def _static_input_scales(parts, activation_scales, reading) -> Dict[str, torch.Tensor]:
    """Module name -> the 0-dim fp32 ``input_scale`` its layer applies (static per-tensor W8A8): the quantized linears
    whose checkpoint scheme quantizes activations statically per tensor in FP8 (``reading.static_input``). Linears
    that vLLM fuses (q/k/v, gate/up) get the largest of their group's scales, as vLLM's fused layer does."""
    static = {name: layouts.input_scale_value(name, activation_scales[name]["input_scale"]) for name in parts
              if "input_scale" in activation_scales.get(name, {}) and reading.static_input(name)}
    for group in fused_groups(static):
        values = [static[name] for name in group]
        shared = torch.stack(values).max()
        if any(not torch.equal(v, shared) for v in values):
            warnings.warn(layouts.UnsharedInputScalesWarning(
                f"{list(group)} have different static input_scale values ({[v.item() for v in values]}); each runs "
                f"with the largest, {shared.item()!r}, as vLLM's fused layer does"), stacklevel=3)
        static.update((name, shared.clone()) for name in group)
    return static


def _expert_input_scale(target: str, by_part, inputs, reading) -> Optional[torch.Tensor]:
    """The one static per-tensor FP8 input scale (0-dim fp32) the quantized expert stack ``target`` runs with, or
    ``None`` (weight-only): where the checkpoint says its per-expert modules' activations are quantized statically per
    tensor in FP8 (``reading.static_input`` of ``<...>.experts.{e}.gate_proj`` ...), the largest of all its experts'
    stored ``input_scale`` values (gate's and up's for ``gate_up_proj``), as vLLM's FP8 MoE methods take them: their
    ``FusedMoE.weight_loader`` keeps one input scale per expert for ``w13`` (gate and up) and ``w2``, and
    ``process_weights_after_loading`` replaces each by its ``.max()`` over the experts, logging "Found input_scales
    that are not equal for fp8 MoE layer. Using the maximum across experts for each layer." (vLLM
    ``model_executor/layers/quantization/fp8.py`` ``Fp8MoEMethod``, ``compressed_tensors_moe.py``
    ``CompressedTensorsW8A8Fp8MoEMethod``). :class:`~ds_fpquant.checkpoint.layouts.UnsharedInputScalesWarning` when
    they differ.

    Raises ``ValueError`` when some of the stack's matrices carry a static input scale and others none."""
    static = {slot: entry for slot, entry in inputs.items() if reading.static_input(entry[0])}
    if not static:
        return None
    missing = sorted(set(by_part) - set(static))
    if missing:
        raise ValueError(f"{target}: the checkpoint has static input_scale values for some expert matrices but not for "
                         f"{[f'expert {e} part {p}' for e, p in missing]}; load_quantized(path, activation=None) loads "
                         f"the experts weight-only")
    values = [layouts.input_scale_value(entry[0], entry[2]) for _, entry in sorted(static.items())]
    shared = torch.stack(values).max()
    if any(not torch.equal(v, shared) for v in values):
        distinct = sorted({v.item() for v in values})
        warnings.warn(layouts.UnsharedInputScalesWarning(
            f"{target}: its {len(values)} expert matrices have different static input_scale values ({distinct}); the "
            f"stack runs with the largest, {shared.item()!r}, as vLLM's FP8 MoE layer does"), stacklevel=4)
    return shared.clone()


def _place(key: str, quantized, linears, keys: CheckpointKeys, reading):
    """Where checkpoint tensor ``key`` goes: ``("linear", module, part)`` for a part of a quantized
    linear weight, ``("expert", ExpertPart, part)`` for a per-expert matrix or its scales,
    ``("stack", parameter, part)`` for a stored expert stack, ``(None, None, None)`` for the rest
    (``part``: the layout's suffix without its dot, e.g. ``weight``, ``weight_scale_inv``; ``reading``: the
    layout's :class:`~ds_fpquant.checkpoint.layouts.Reading`, or ``None`` for a full-precision checkpoint)."""
    suffixes = reading.suffixes if reading is not None else (".weight",)
    for suffix in suffixes:
        if not key.endswith(suffix):
            continue
        name = keys.module(key, suffix, linears)
        if name in quantized:
            return "linear", name, suffix[1:]
        part = keys.part(key[:-len(suffix)] + ".weight")
        if part is not None:
            return "expert", part, suffix[1:]
    for suffix, part_name in (reading.stack_suffixes if reading is not None else {"": "weight"}).items():
        target = keys.fused(key[:len(key) - len(suffix)]) if key.endswith(suffix) else None
        if target is not None:
            return "stack", target, part_name
    return None, None, None


def _load_expert_parts(model, keys: CheckpointKeys, target: str, by_part, reading, dtype, state, backend,
                       compute_dtype, input_scale: Optional[torch.Tensor] = None) -> bool:
    """Install the expert parameter ``target`` from its per-expert matrices (``by_part[(e, part)]`` =
    ``{"weight": ..., "weight_scale_inv": ...}``): quantized ones become the module's quantized experts,
    full-precision ones (kept by the writer) are stacked into ``state`` for the plain parameter. ``input_scale``:
    the stack runs static per-tensor W8A8 with it (:func:`_expert_input_scale`). Returns whether the stack is
    installed quantized."""
    module_name, pname = keys.params[target]
    module = model.get_submodule(module_name)
    n_experts, out_features, in_features = module._parameters[pname].shape
    n_parts = 1 + max(p for _, p in by_part)
    check_expert_slots(target, (n_experts, out_features, in_features), {slot: slot for slot in by_part}, n_parts)
    code_parts = reading.code_parts if reading is not None else ("weight",)
    no_weight = [f"expert {e} part {p}" for (e, p), t in sorted(by_part.items()) if not set(code_parts) & set(t)]
    if no_weight:
        raise ValueError(f"{target}: the checkpoint has scales but no weight for {no_weight}")
    is_quantized = {p: len(t) > 1 or "weight" not in t
                    or t["weight"].dtype not in (torch.float32, torch.float16, torch.bfloat16)
                    for p, t in by_part.items()}
    if not any(is_quantized.values()):
        state[target] = torch.stack([torch.cat([by_part[(e, p)]["weight"] for p in range(n_parts)])
                                     for e in range(n_experts)])
        return False
    if not all(is_quantized.values()):
        raise ValueError(f"{target}: some expert matrices are quantized and some are not; ds_fpquant loads an expert "
                         f"parameter whole, quantized or not")
    pieces = nvfp4_beside_e2m1([reading.from_parts(f"{target}[expert {e}, part {p}]", by_part[(e, p)],
                                                   (_rows(by_part[(e, p)], code_parts), in_features), dtype)
                                for e in range(n_experts) for p in range(n_parts)])  # one layout for all
    qts = []
    for e in range(n_experts):
        try:
            qts.append(join_rows(pieces[e * n_parts:(e + 1) * n_parts]))
        except ValueError as exc:
            raise ValueError(f"{target}[expert {e}]: {exc}") from None
    if tuple(qts[0].shape) != (out_features, in_features):
        raise ValueError(f"{target}: the expert matrices join to {tuple(qts[0].shape)}; the model needs "
                         f"({out_features}, {in_features})")
    _install(module, pname, target, qts, backend, compute_dtype, input_scale)
    return True


def _rows(parts: Dict[str, torch.Tensor], code_parts) -> int:
    """The rows of one stored expert matrix: its codes' first dimension."""
    return next(parts[p] for p in code_parts if p in parts).shape[0]


def _install(module, pname: str, target: str, qts, backend, compute_dtype, input_scale=None) -> None:
    try:
        install_quantized_experts(module, pname, qts, compute_dtype=compute_dtype, backend=backend,
                                  activation=None if input_scale is None else "e4m3", input_scale=input_scale)
    except ValueError as exc:
        hint = "" if input_scale is None else "; load_quantized(path, activation=None) loads the experts weight-only"
        raise ValueError(f"{target}: {exc}{hint}") from None


def _load_fused_experts(model, keys: CheckpointKeys, target: str, tensors, reading, dtype, state, backend,
                        compute_dtype) -> None:
    """Install the expert parameter ``target`` from a stored stack (``<target>`` ``(E, ...)`` plus
    ``<target>_scale_inv`` / ``_scale`` / ``_scale_2``, transformers' fused FP8 layout)."""
    module_name, pname = keys.params[target]
    module = model.get_submodule(module_name)
    shape = tuple(module._parameters[pname].shape)
    if set(tensors) == {"weight"} and tensors["weight"].dtype in (torch.float32, torch.float16, torch.bfloat16):
        state[target] = tensors["weight"]
        return
    if any(t.shape[:1] != shape[:1] for t in tensors.values()):
        raise ValueError(f"{target}: a stored expert stack has {shape[0]} experts in its first dimension; got "
                         f"{ {k: tuple(t.shape) for k, t in tensors.items()} }")
    matrix = expert_matrix_shape(module, pname)  # (out, in); the parameter is (E, in, out) for transposed experts
    qts = [reading.from_parts(f"{target}[expert {e}]", {k: t[e] for k, t in tensors.items()}, matrix, dtype)
           for e in range(shape[0])]
    _install(module, pname, target, qts, backend, compute_dtype)


def _assign_rest(model: torch.nn.Module, state: Dict[str, torch.Tensor], keys: CheckpointKeys) -> None:
    """Assign the unquantized tensors, tie weights, and initialise what no file holds (non-persistent
    buffers such as position ids) the way transformers' ``from_pretrained`` does: every loaded tensor
    and every module without such a buffer is flagged ``_is_hf_initialized``, and
    ``model.initialize_weights()`` runs the model's ``_init_weights`` on the rest."""
    expected = set(model.state_dict())
    renamed, sources = {}, {}
    for key, tensor in state.items():
        name = keys.resolve(key, expected) or key
        if sources.setdefault(name, key) != key:
            raise ValueError(f"{sources[name]} and {key} are both {name}")
        renamed[name] = tensor
    try:
        result = model.load_state_dict(renamed, strict=False, assign=True)
    except RuntimeError as exc:  # shapes that do not fit the model
        raise ValueError(f"the checkpoint's tensors do not fit {type(model).__name__}: {exc}") from None
    non_persistent = dict(model.named_buffers())  # e.g. BERT's position_ids, saved by older versions
    unexpected = [key for key in result.unexpected_keys if key not in non_persistent]
    if unexpected:
        raise ValueError(f"tensors the model has no place for: {unexpected}")
    for key in result.unexpected_keys:
        owner, _, name = key.rpartition(".")
        model.get_submodule(owner)._buffers[name] = renamed[key]
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint lacks these weights of {type(model).__name__}: {missing}")
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor._is_hf_initialized = True
    for module in model.modules():  # only modules left with meta buffers get transformers' init
        pending = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for name in pending:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        module._is_hf_initialized = not pending
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()


def _quantize_while_loading(path, hf_config, fp_quantization, model_class):
    """:func:`load_quantized` of a full-precision checkpoint with ``fp_quantization`` settings."""
    from ds_fpquant.config import load_config

    config = load_config(fp_quantization)
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"path={str(path)!r} is already quantized (quantization_config="
                         f"{hf_config.quantization_config}); load it without fp_quantization")
    model = meta_model(hf_config, model_class)
    plan = plan_quantizing(model, path, config, hf_config)
    state = read_quantizing(model, plan)
    _assign_rest(model, state, plan.keys)
    enable_save_pretrained(model)
    return model.eval()


@dataclass
class QuantizingCheckpoint:
    """What :func:`read_quantizing` quantizes from a full-precision checkpoint into a model on the meta device
    (:func:`plan_quantizing`): the ``fp_quantization`` section, the shards and headers, the model's linears and
    keys, and the :class:`~ds_fpquant.checkpoint.keys.QuantizationPlan` of what the settings select."""

    config: Any
    dtype: Optional[torch.dtype]
    files: List[Any]
    headers: Dict[str, Tuple[str, Tuple[int, ...]]]
    linears: Dict[str, bool]
    keys: CheckpointKeys
    selected: Any

    def owned(self) -> Set[str]:
        """The checkpoint keys :func:`read_quantizing` quantizes or installs with a quantized weight: the selected
        linears' weights and biases, the selected expert matrices and stacks."""
        selected, stored = self.selected, self.selected.weights
        biases = {stored[name][:-len("weight")] + "bias" for name in selected.linears.values()}
        return {*selected.linears, *(b for b in biases if b in self.headers), *selected.experts, *selected.stacks}


def plan_quantizing(model: torch.nn.Module, path, config, hf_config) -> QuantizingCheckpoint:
    """The :class:`QuantizingCheckpoint` of the full-precision checkpoint directory ``path`` for ``model`` (on the
    meta device) with the ``fp_quantization`` section ``config``, from the headers: ``ValueError`` for patterns that
    match nothing or tensors that do not fit the model, before any tensor is read."""
    linears, keys = linear_modules(model), CheckpointKeys(model)
    given = [*(config.exclude if "exclude" in config.model_fields_set else ()), *config.modules]
    check_patterns(given, [*linears, *keys.params], "fp_quantization patterns")
    files = shard_files(path)
    headers = tensor_headers(files)
    keys.check_fits(headers)  # every parameter there, in its shape, before anything is read or quantized
    dtype = getattr(hf_config, "dtype", None)  # what from_pretrained gives the weights (its dtype="auto")
    dtype = getattr(torch, str(dtype).replace("torch.", "")) if dtype else None
    return QuantizingCheckpoint(config, dtype, files, headers, linears, keys,
                                keys.plan(headers, linears, config.settings_for))


def read_quantizing(model: torch.nn.Module, plan: QuantizingCheckpoint,
                    only: Optional[Set[str]] = None) -> Dict[str, torch.Tensor]:
    """Read the checkpoint of ``plan`` one tensor at a time into ``model``: a linear or expert weight the settings
    select is quantized as it is read (:func:`load_quantized` with ``fp_quantization``). ``only``: read just these keys
    (``plan.owned()``). Returns the other tensors read (name -> tensor)."""
    from ds_fpquant.nn.experts import install_quantized_experts
    from ds_fpquant.nn.model_walk import as_linear, parent_module
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    config, files, headers, keys, selected, dtype = plan.config, plan.files, plan.headers, plan.keys, plan.selected, \
        plan.dtype
    stored, plan, expert_plan, stacks = selected.weights, selected.linears, selected.experts, selected.stacks
    biases = {key: name for name in plan.values() if (key := stored[name][:-len("weight")] + "bias") in headers}
    layer = dict(compute_dtype=config.compute_dtype, backend=config.backend, activation=config.activation)
    weights, bias_of, experts, pending, state, kept_experts = {}, {}, {}, {}, {}, {}
    group_of = {name: group for group in shared_scale_groups(plan.values(), config.settings_for) for name in group}
    skip = () if only is None else set(headers) - set(only)
    for key, tensor in iter_tensors(files, skip):
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if key in plan:
            weights[plan[key]] = tensor
        elif key in biases:
            bias_of[biases[key]] = tensor
        elif key in expert_plan:  # an expert's gate, up or down: its fused row block quantized as apply does
            part = expert_plan[key]
            parts = pending.setdefault((part.target, part.expert), {})
            parts[part.part] = tensor
            if len(parts) == part.parts:
                del pending[(part.target, part.expert)]
                matrix = torch.cat([parts[i] for i in range(part.parts)])
                experts.setdefault(part.target, {})[part.expert] = quantize(
                    matrix, **config.settings_for(part.target), backend=config.backend)
        elif key in stacks:
            owner = model.get_submodule(keys.params[stacks[key]][0])
            experts[stacks[key]] = dict(enumerate(quantize(expert_matrix(owner, tensor, e), **config.settings_for(
                stacks[key]), backend=config.backend) for e in range(tensor.shape[0])))
        elif (part := keys.part(key)) is not None:  # an excluded expert's matrix: stacked as transformers does
            kept_experts.setdefault(part.target, {})[(part.expert, part.part)] = {"weight": tensor}
        else:
            state[key] = tensor
        read = [n for n in weights if n in bias_of or stored[n][:-len("weight")] + "bias" not in headers]
        # NVFP4 layers that serving engines fuse wait for the rest of their group: one shared tensor scale
        ready = [n for n in read if all(m in read for m in group_of.get(n, ()))]
        shared = {}
        for group in {group_of[n] for n in ready if n in group_of}:
            t = nvfp4_shared_tensor_scale([weights[m] for m in group])
            shared.update((m, t) for m in group)
        for name in ready:
            module = model.get_submodule(name)  # weight (and bias) read: quantize it now, drop the tensor
            linear = as_linear(_with_weights(module, weights.pop(name), bias_of.pop(name, None)))
            parent, child = parent_module(model, name)
            settings = {**config.settings_for(name), **({"tensor_scale": shared[name]} if name in shared else {})}
            setattr(parent, child, FPQuantizedLinear.from_linear(linear, **layer, **settings))
    for target, by_expert in experts.items():
        module_name, pname = keys.params[target]
        install_quantized_experts(model.get_submodule(module_name), pname, [by_expert[e] for e in sorted(by_expert)],
                                  **layer)
    for target, by_part in kept_experts.items():  # full precision: the (E, out, in) parameter, no quantization
        _load_expert_parts(model, keys, target, by_part, None, None, state, None, None)
    return state


def _with_weights(module: torch.nn.Module, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.nn.Module:
    """``module`` (an ``nn.Linear`` or ``Conv1D`` on the meta device) holding ``weight`` and ``bias`` as read."""
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        module.bias = torch.nn.Parameter(bias, requires_grad=False)
    return module
