"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, llm-compressor's output; the
conventions of compressed-tensors 0.20.1), read without requantizing (``docs/checkpoints.md``).

Formats read (per ``config_groups`` entry, ``weights`` of ``type: "float"``, ``symmetric: true``, static):

- ``float-quantized`` / ``naive-quantized``, 8 bits: ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)`` and
  ``<m>.weight_scale`` (fp32 / bf16 / fp16 multipliers, widened exactly): ``strategy`` ``tensor`` (one scale,
  ``(1,)``) -> one ``(N, K)`` block; ``channel`` ``(N, 1)`` -> row groups of ``K``; ``block``
  (``block_structure [Br, Bc]``, ``(ceil(N/Br), ceil(K/Bc))``) -> 2-D blocks; ``group`` (``group_size G``,
  ``(N, K/G)``) -> row groups of ``G``.
- ``mxfp8-quantized``: e4m3 ``weight`` with ``weight_scale`` ``uint8`` E8M0 bytes ``(N, K/32)`` -> ``mxfp8_e4m3``.
- ``mxfp4-pack-quantized``: ``weight_packed`` ``uint8`` ``(N, K/2)`` (two e2m1 codes a byte, the first in the
  low nibble) with E8M0 ``weight_scale`` ``(N, K/32)`` -> ``mxfp4``.
- ``mxfp6-pack-quantized`` (``num_bits: 6``, compressed-tensors' only 6-bit float, E2M3): ``weight_packed``
  ``uint8`` ``(N, 3K/4)``, four 6-bit codes (sign in bit 5) in a 3-byte little-endian word, the first code in the
  lowest bits (``pack_fp6_to_uint8``): SPEC 6's bit stream byte for byte, so no repacking; with E8M0
  ``weight_scale`` ``(N, K/32)`` -> ``mxfp6_e2m3``.
- ``nvfp4-pack-quantized``: ``weight_packed`` as above, ``weight_scale`` ``float8_e4m3fn`` ``(N, K/16)`` and
  ``weight_global_scale`` fp32 ``(1,)``, a *divisor*: compressed-tensors dequantizes
  ``w = fl(decode(q) * fl(decode(c) / g))`` in fp32 (then rounds to the model dtype). ds_fpquant's NVFP4
  multiplies by ``t`` (SPEC 3.4), so the weight is read as ``nvfp4`` with ``t = fl(1 / g)`` when
  ``fl(decode(c) * t) == fl(decode(c) / g)`` for every group scale code the weight uses (bit-exact), else as
  ``e2m1`` row groups of 16 with the fp32 scales ``fl(decode(c) / g)`` (bit-exact too; 4-byte scales).

``input_scale`` / ``input_global_scale`` (static activation quantization) are recorded on the model; a group whose
``input_activations`` are static per-tensor FP8 (``type: "float"``, ``num_bits: 8``, ``strategy: "tensor"``,
``dynamic: false``, symmetric: the ``FP8`` preset) has its linears run static W8A8 with their ``input_scale``
(SPEC 8.3); others (NVFP4's ``input_global_scale``) are not applied
(:class:`~ds_fpquant.checkpoint.layouts.StaticActivationScalesWarning`). Refused with a
``ValueError``: integer schemes, asymmetric weights (zero points), dynamic weights, other formats
(``pack-quantized``, ``int-quantized``, sparse ones), ``kv_cache_scheme``,
``transform_config``, ``sparsity_config``, and checkpoints not in ``quantization_status: "compressed"``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ds_fpquant.checkpoint.hf_files import CONFIG
from ds_fpquant.checkpoint.layouts import registry as layouts
from ds_fpquant.checkpoint.layouts.registry import checked
from ds_fpquant.numerics.scales import SCALE_FLOOR
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

METHOD = "compressed-tensors"

#: format -> (num_bits, the strategies it is written with)
FORMATS = {
    "float-quantized": (8, ("tensor", "channel", "block", "group")),
    "naive-quantized": (8, ("tensor", "channel", "block", "group")),
    "mxfp8-quantized": (8, ("group",)),
    "mxfp4-pack-quantized": (4, ("group",)),
    "mxfp6-pack-quantized": (6, ("group",)),
    "nvfp4-pack-quantized": (4, ("tensor_group",)),
}

SUFFIXES = (".weight", ".weight_packed", ".weight_scale", ".weight_global_scale", ".weight_zero_point",
            ".input_scale", ".input_global_scale", ".input_zero_point")
ACTIVATION_PARTS = ("input_scale", "input_global_scale")

_E4M3_VALUES = None


def _e4m3_values() -> torch.Tensor:
    global _E4M3_VALUES
    if _E4M3_VALUES is None:
        _E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return _E4M3_VALUES


def _check_args(args, where: str, fmt: str) -> Dict[str, Any]:
    if not isinstance(args, dict):
        raise ValueError(f"{where}.weights={args!r} must be an object")
    bits, strategies = FORMATS[fmt]
    if args.get("type") != "float":
        raise ValueError(f"{where}.weights.type={args.get('type')!r}: ds_fpquant reads float schemes only "
                         f"(integer compressed-tensors schemes are not supported)")
    if args.get("num_bits") != bits:
        raise ValueError(f"{where}.weights.num_bits={args.get('num_bits')!r}; format {fmt!r} has {bits}")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}.weights.symmetric={args.get('symmetric')!r}: asymmetric (zero-point) weights "
                         f"are not supported")
    if args.get("dynamic", False) not in (False, None):
        raise ValueError(f"{where}.weights.dynamic={args.get('dynamic')!r}: a checkpoint's weights are static")
    strategy = args.get("strategy")
    if strategy not in strategies:
        raise ValueError(f"{where}.weights.strategy={strategy!r}; format {fmt!r} allows {', '.join(strategies)}")
    if strategy == "block":
        block = args.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in block)):
            raise ValueError(f"{where}.weights.block_structure={block!r} must be [Br, Bc], two ints >= 1")
    if strategy in ("group", "tensor_group"):
        group = args.get("group_size")
        want = {"mxfp8-quantized": 32, "mxfp4-pack-quantized": 32, "mxfp6-pack-quantized": 32,
                "nvfp4-pack-quantized": 16}.get(fmt)
        if not (isinstance(group, int) and not isinstance(group, bool) and group >= 1) or (want and group != want):
            raise ValueError(f"{where}.weights.group_size={group!r} must be {want or 'an int >= 1'} for {fmt!r}")
    return args


def _check(qconfig: Dict[str, Any], path: Path):
    where = f"{str(path / CONFIG)!r}: quantization_config"
    status = qconfig.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status={status!r}: only 'compressed' checkpoints hold quantized "
                         f"weights")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qconfig.get(key):
            raise ValueError(f"{where}.{key}={qconfig[key]!r}: not supported (ds_fpquant reads weight quantization only)")
    ignore = qconfig.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(v, str) for v in ignore):
        raise ValueError(f"{where}.ignore={ignore!r} must be a list of module names ('re:' for a regex)")
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups={groups!r} must be a non-empty object of schemes")
    checked_groups = []
    for gname, group in groups.items():
        gwhere = f"{where}.config_groups.{gname}"
        if not isinstance(group, dict):
            raise ValueError(f"{gwhere}={group!r} must be an object")
        fmt = group.get("format") or qconfig.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"{gwhere}.format={fmt!r}; ds_fpquant reads {', '.join(FORMATS)}")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{gwhere}.targets={targets!r} must be a non-empty list of names")
        if group.get("output_activations"):
            raise ValueError(f"{gwhere}.output_activations={group['output_activations']!r}: not supported")
        checked_groups.append((gname, targets, fmt, _check_args(group.get("weights"), gwhere, fmt),
                               static_fp8_input(group.get("input_activations"))))
    return checked_groups, tuple(ignore)


def static_fp8_input(args) -> bool:
    """Whether a scheme's ``input_activations`` are static per-tensor FP8 (``type: "float"``, ``num_bits: 8``,
    ``strategy: "tensor"``, ``dynamic: false``, symmetric): what ds_fpquant applies as static W8A8."""
    return (isinstance(args, dict) and args.get("type") == "float" and args.get("num_bits") == 8
            and args.get("strategy") == "tensor" and args.get("dynamic", False) is False
            and args.get("symmetric", True) is True)


def _target_rank(target: str, name: str) -> Optional[int]:
    """How specifically ``target`` names module ``name`` (compressed-tensors' precedence: exact name, then
    regex, then the class ``Linear``, which every quantized weight here is); ``None``: it does not."""
    if target == name:
        return 0
    if target.startswith("re:") and re.match(target[3:], name):
        return 1
    if target == "Linear":
        return 2
    return None


def _scheme_for(groups, name: str, with_input: bool = False):
    """``(format, weight args)`` of the group that targets ``name`` (plus whether its activations are static
    per-tensor FP8, ``with_input``)."""
    ranked = sorted((rank, gname, fmt, args, static) for gname, targets, fmt, args, static in groups
                    if (rank := min((r for t in targets if (r := _target_rank(t, name)) is not None),
                                    default=None)) is not None)
    if not ranked:
        raise ValueError(f"{name}: stored quantized, but no quantization_config.config_groups entry targets it")
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        raise ValueError(f"{name}: config_groups {ranked[0][1]!r} and {ranked[1][1]!r} both target it")
    return ranked[0][2:] if with_input else (ranked[0][2], ranked[0][3])


def _nvfp4(name: str, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, shape, dtype):
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight_scale: NVFP4 group scales are float8_e4m3fn, got {scales.dtype}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"{name}.weight_global_scale: one float32 value, got {global_scale.dtype} of shape "
                         f"{tuple(global_scale.shape)}")
    g = global_scale.reshape(())
    if not (torch.isfinite(g) and g > 0):
        raise ValueError(f"{name}.weight_global_scale={g.item()!r} must be finite and > 0 (it divides the scales)")
    codes = scales.view(torch.uint8)
    values = _e4m3_values()
    t = torch.ones((), dtype=torch.float32) / g  # fl(1 / g)
    used = torch.unique(codes.reshape(-1)).long()
    nan_codes = torch.isnan(values[used])
    # every code the weight uses (NaN codes are NaN both ways) scales the same through t as through 1/g
    exact_t = bool(torch.equal((values[used] * t)[~nan_codes], (values[used] / g)[~nan_codes]))
    if exact_t and t.item() >= SCALE_FLOOR and not bool((used >= 0x80).any()):
        return QuantizedTensor(codes=packed, scales=codes, shape=torch.Size(shape), dtype=dtype, fmt="nvfp4",
                               group_size=16, scale_format="e4m3", tensor_scale=t)
    return QuantizedTensor(codes=packed, scales=values[codes.long()] / g, shape=torch.Size(shape), dtype=dtype,
                           fmt="e2m1", group_size=16)


def _make_reading(qconfig: Dict[str, Any], path: Path) -> layouts.Reading:
    groups, ignore = _check(qconfig, path)

    def from_parts(name: str, parts: Dict[str, torch.Tensor], shape, dtype) -> QuantizedTensor:
        fmt, args = _scheme_for(groups, name)
        n, k = shape
        if fmt.endswith("pack-quantized"):
            required = ("weight_packed", "weight_scale") + (("weight_global_scale",) if fmt.startswith("nvfp4") else ())
            layouts.check_parts(name, f"{METHOD} {fmt}", parts, required)
            packed, scales = parts["weight_packed"], parts["weight_scale"]
            if packed.dtype != torch.uint8:
                raise ValueError(f"{name}.weight_packed: packed {fmt} codes are uint8, got {packed.dtype}")
            if fmt.startswith("nvfp4"):
                qt = _nvfp4(name, packed, scales, parts["weight_global_scale"], shape, dtype)
            else:
                if scales.dtype != torch.uint8:
                    raise ValueError(f"{name}.weight_scale: MX scales are uint8 E8M0 bytes, got {scales.dtype}")
                # mxfp6: compressed-tensors' 6-bit codes are e2m3 (FP6_E2M3_DATA, the only 6-bit float it has),
                # four a 3-byte little-endian word, the first in the low bits: SPEC 6's bit stream, byte for byte
                qt = QuantizedTensor(codes=packed, scales=scales, shape=torch.Size(shape), dtype=dtype,
                                     fmt="mxfp6_e2m3" if fmt.startswith("mxfp6") else "mxfp4", group_size=32,
                                     scale_format="e8m0")
            return checked(name, qt)
        layouts.check_parts(name, f"{METHOD} {fmt}", parts, ("weight", "weight_scale"))
        weight, scale = parts["weight"], parts["weight_scale"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.weight: a {fmt!r} 8-bit float weight is float8_e4m3fn, got {weight.dtype}")
        codes = weight.view(torch.uint8)
        if fmt == "mxfp8-quantized":
            if scale.dtype != torch.uint8:
                raise ValueError(f"{name}.weight_scale: MX scales are uint8 E8M0 bytes, got {scale.dtype}")
            qt = QuantizedTensor(codes=codes, scales=scale, shape=torch.Size(shape), dtype=dtype, fmt="mxfp8_e4m3",
                                 group_size=32, scale_format="e8m0")
            return checked(name, qt)
        scales = layouts.widen_scales(name, "weight_scale", scale)
        strategy = args["strategy"]
        common = dict(codes=codes, shape=torch.Size(shape), dtype=dtype, fmt="e4m3")
        if strategy == "tensor":
            if scales.numel() != 1:
                raise ValueError(f"{name}.weight_scale: a per-tensor scale is one value; got shape {tuple(scale.shape)}")
            qt = QuantizedTensor(scales=scales.reshape(1, 1), group_size=k, block=(n, k), **common)
        elif strategy == "channel":
            if tuple(scales.shape) not in ((n, 1), (n,)):
                raise ValueError(f"{name}.weight_scale: per-channel scales are ({n}, 1); got {tuple(scale.shape)}")
            qt = QuantizedTensor(scales=scales.reshape(n, 1), group_size=k, **common)
        elif strategy == "block":
            br, bc = args["block_structure"]
            qt = QuantizedTensor(scales=scales, group_size=bc, block=(br, bc), **common)
        else:
            qt = QuantizedTensor(scales=scales, group_size=args["group_size"], **common)
        return checked(name, qt)

    return layouts.Reading(method=METHOD, own={}, suffixes=SUFFIXES, code_dtypes=("F8_E4M3",), from_parts=from_parts,
                           activation_parts=ACTIVATION_PARTS, code_parts=("weight", "weight_packed"), ignore=ignore,
                           static_input=lambda name: _scheme_for(groups, name, with_input=True)[2])


layouts.register((METHOD,), _make_reading)
