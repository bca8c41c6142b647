"""The registry of on-disk layouts (:mod:`ds_fpquant.checkpoint.layouts`): :class:`Reading`, :func:`register`,
:func:`reading_for`; the layout modules import it, the package imports them.
"""


from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ds_fpquant.checkpoint.hf_files import CONFIG
from ds_fpquant.numerics.scales import SCALE_FLOOR

__all__ = ["Reading", "StaticActivationScalesWarning", "UnsharedInputScalesWarning", "register", "input_scale_value", "register_config_finder", "reading_for",
           "find_qconfig", "ignore_matches"]


class StaticActivationScalesWarning(UserWarning):
    """The checkpoint stores static activation scales that ds_fpquant does not apply (NVFP4's ``input_scale`` /
    ``input_global_scale``: FP4 activations; FP8 ``input_scale`` of schemes other than static per-tensor FP8): it
    loads the weights and records the scales (``model.ds_fpquant_activation_scales``); those layers run weight-only.
    Static per-tensor FP8 ``input_scale`` of linears and of per-expert matrices is applied (static W8A8; an expert
    stack takes the largest of its experts'), not warned."""


class UnsharedInputScalesWarning(UserWarning):
    """Linears that vLLM fuses (q/k/v, gate/up: :data:`~ds_fpquant.nn.model_walk.FUSED_LINEARS`) have different
    static ``input_scale`` values in the checkpoint; :func:`~ds_fpquant.load_quantized` gives each the largest, as
    vLLM does (the stored values stay in ``model.ds_fpquant_activation_scales``). Likewise the experts of one MoE
    expert stack (gate and up included): the stack runs with the largest, as vLLM's FP8 MoE layer does."""


@dataclass
class Reading:
    """What a layout makes of one checkpoint's ``quantization_config``.

    Attributes:
        method: the ``quant_method`` (for messages).
        own: ``quantization_config.ds_fpquant`` as checked (``weight_dtype``, ``transposed``); ``{}`` for
            checkpoints of other tools.
        suffixes: key suffixes of the tensors of one quantized weight, ``.weight`` included where the layout
            stores codes there (e.g. ``(".weight", ".weight_scale_inv")``); a module holding any suffix other
            than ``.weight``, or a ``.weight`` of one of ``code_dtypes``, is a quantized weight.
        code_dtypes: safetensors dtype names (``"F8_E4M3"``, ``"U8"``) of a quantized ``.weight``.
        from_parts: ``(name, parts, shape, dtype) -> QuantizedTensor``: one weight from its tensors
            (``parts``: part name, the suffix without its dot -> tensor; ``shape``: ``(N, K)``), checked
            (``ValueError`` naming ``name``).
        code_parts: the part names that hold the codes (their first dimension is the matrix's rows).
        activation_parts: part names that are activation scales: taken out before ``from_parts`` and recorded
            on the model; applied only where ``static_input`` says so, else warned
            (:class:`StaticActivationScalesWarning`).
        static_input: ``name -> bool``: whether module ``name``'s ``input_scale`` is a static per-tensor FP8
            activation scale (the checkpoint says its activations are quantized that way): the loaded layer then
            runs static W8A8 with it (SPEC 8.3).
        ignore: module names the checkpoint says it did not quantize (exact names; ``re:<regex>`` entries
            match with ``re.match``, as compressed-tensors writes them); a quantized weight among them is a
            ``ValueError``.
        stack_suffixes: suffixes of a stored ``(E, ...)`` expert stack ``<p>`` -> part name (transformers'
            fused layout, ``<p>_scale_inv``); default: derived from ``suffixes``.
    """

    method: str
    own: Dict[str, Any]
    suffixes: Tuple[str, ...]
    code_dtypes: Tuple[str, ...]
    from_parts: Callable[..., Any]
    activation_parts: Tuple[str, ...] = ()
    code_parts: Tuple[str, ...] = ("weight",)
    ignore: Tuple[str, ...] = ()
    stack_suffixes: Dict[str, str] = field(default_factory=dict)
    static_input: Callable[[str], bool] = lambda name: False

    def __post_init__(self):
        if not self.stack_suffixes:
            stack = {s[len(".weight"):]: s[1:] for s in self.suffixes if s.startswith(".weight")}
            # longest first, so that "_scale_inv" is tried before "_scale" and "" last
            self.stack_suffixes = dict(sorted(stack.items(), key=lambda item: -len(item[0])))

    def ignored(self, name: str) -> bool:
        """Whether module ``name`` is in the checkpoint's ``ignore`` list (:func:`ignore_matches`)."""
        return ignore_matches(self.ignore, name)


def ignore_matches(entries, name: str) -> bool:
    """Whether module ``name`` matches one of ``entries``: ``re:<regex>`` with ``re.match`` (compressed-tensors'
    rule), else the exact name or a module under it (``entry + "."`` prefix)."""
    for entry in entries:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.startswith(entry + "."):
            return True
    return False


_LAYOUTS: Dict[str, Callable[[Dict[str, Any], Path], Reading]] = {}
_CONFIG_FINDERS: List[Callable[[Path], Optional[Dict[str, Any]]]] = []


def register(methods, make_reading: Callable[[Dict[str, Any], Path], Reading]) -> None:
    """Register ``make_reading(qconfig, path) -> Reading`` for each ``quant_method`` in ``methods``."""
    for method in methods:
        if method in _LAYOUTS:
            raise ValueError(f"quant_method {method!r} is registered twice")
        _LAYOUTS[method] = make_reading


def register_config_finder(find: Callable[[Path], Optional[Dict[str, Any]]]) -> None:
    """Register ``find(path) -> quantization_config or None`` for checkpoints whose ``config.json`` has no
    ``quantization_config`` (a description in a file of its own)."""
    _CONFIG_FINDERS.append(find)


def find_qconfig(hf_config, path: Path) -> Optional[Dict[str, Any]]:
    """The checkpoint's quantization description: ``config.json``'s ``quantization_config`` (a dict; a
    transformers config object is turned into one), else the first registered finder's, else ``None``."""
    qconfig = getattr(hf_config, "quantization_config", None)
    if qconfig is not None and not isinstance(qconfig, dict) and hasattr(qconfig, "to_dict"):
        qconfig = qconfig.to_dict()
    if qconfig:
        return qconfig
    for find in _CONFIG_FINDERS:
        found = find(path)
        if found:
            return found
    return qconfig


def reading_for(qconfig, path: Path) -> Reading:
    """The :class:`Reading` of ``qconfig`` by its ``quant_method`` (``ValueError`` for an unknown or missing one)."""
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
    if method not in _LAYOUTS:
        raise ValueError(f"{str(Path(path) / CONFIG)!r}: quantization_config={qconfig!r}; expected quant_method "
                         f"one of {', '.join(repr(m) for m in sorted(_LAYOUTS))} (write one with `ds-fpquant quantize`)")
    return _LAYOUTS[method](qconfig, Path(path))


def widen_scales(name: str, part: str, scales: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 / fp16 scales as fp32 (exact: every bf16 and fp16 value is an fp32 value); ``ValueError``
    for other dtypes."""
    if scales.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}.{part}: scales are float32, bfloat16 or float16; got {scales.dtype}")
    return scales.to(torch.float32)


def check_parts(name: str, method: str, parts: Dict[str, torch.Tensor], required, optional=()) -> None:
    """``ValueError`` unless ``parts`` holds every ``required`` part and nothing beyond ``required`` and ``optional``."""
    missing = [f"{name}.{p}" for p in required if p not in parts]
    extra = [f"{name}.{p}" for p in parts if p not in required and p not in optional]
    if missing or extra:
        raise ValueError(f"{name}: a {method!r} weight has the tensors {', '.join(required)}; "
                         f"missing: {missing}, unexpected: {extra}")


def input_scale_value(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A stored static per-tensor activation scale ``<name>.input_scale`` as the 0-dim fp32 tensor the layer takes:
    one value (shape ``()`` or ``(1,)``), fp32 / bf16 / fp16 (widened exactly), finite and > 0; ``ValueError``
    naming it otherwise."""
    if tensor.numel() != 1 or tensor.dim() > 1:
        raise ValueError(f"{name}.input_scale: a static per-tensor activation scale is one value (shape () or (1,)); "
                         f"got shape {tuple(tensor.shape)}")
    value = widen_scales(name, "input_scale", tensor).reshape(()).clone()
    if not (torch.isfinite(value) and value > 0):
        raise ValueError(f"{name}.input_scale={value.item()!r} must be finite and > 0 (it divides the activations)")
    return value


def checked(name: str, qt, scale_values: bool = True):
    """``qt`` validated (``qt.validate()``) and, with ``scale_values``, its scale values checked
    (:func:`check_scale_values`); ``ValueError`` / ``TypeError`` naming ``name``. Every reader's last step."""
    try:
        qt.validate()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    if scale_values:
        check_scale_values(name, qt)
    return qt


def check_scale_values(name: str, qt) -> None:
    """Stored scales must be what SPEC 3 can produce: fp32 scales positive (NaN marks a faulty group),
    NVFP4 scale codes non-negative and a finite tensor scale >= 2^-126; E8M0 bytes are all valid."""
    if qt.scale_format == "fp32":
        bad = ~(torch.isnan(qt.scales) | ((qt.scales > 0) & torch.isfinite(qt.scales)))
        if bool(bad.any()):
            raise ValueError(f"{name}: scales must be finite and > 0 (or NaN for a faulty group, SPEC 3.3); "
                             f"found {qt.scales[bad].reshape(-1)[0].item()!r}")
    if qt.tensor_scale is not None:
        if bool((qt.scales >= 0x80).any()):
            raise ValueError(f"{name}.weight_scale: NVFP4 group scale codes are non-negative e4m3 (SPEC 3.4); "
                             f"found a negative one")
        t = qt.tensor_scale.item()
        if not (math.isfinite(t) and t >= SCALE_FLOOR):
            raise ValueError(f"{name}.weight_scale_2={t!r}: the NVFP4 tensor scale is finite and >= 2^-126 (SPEC 3.4)")
