"""Layer 6, config: the ``"fp_quantization"`` section of a DeepSpeed config (pydantic, like DeepSpeed's own configs).

It is a top-level section: DeepSpeed ignores unknown top-level keys, while its
``weight_quantization`` and inference configs forbid extra fields. Example::

    {
      "dtype": "fp16",
      "fp_quantization": {
        "fmt": "e4m3", "group_size": 128,
        "modules": {"mlp": {"fmt": "e2m1", "group_size": 32}, "attn.q_proj": {"enabled": false}},
        "exclude": ["lm_head"]
      }
    }

Patterns in ``modules`` and ``exclude`` are Python regular expressions searched in a module's
qualified name (``model.layers.0.mlp.up_proj``), so a plain name matches as a substring. The first
``modules`` pattern that matches gives the overrides; ``{"enabled": false}`` leaves a module as it is.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, field_validator, model_validator

from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import (
    ACTIVATIONS,
    ALL_SCALE_FORMATS,
    BACKENDS,
    COMPUTE_DTYPE_NAMES,
    GRANULARITIES,
    ROUNDINGS,
    SCALE_FORMATS,
)
from ds_fpquant.numerics.formats import FORMATS, PRESETS, resolve_granularity, resolve_scaling, w8a8_weight_problem

#: The top-level key of the section in a DeepSpeed config.
SECTION = "fp_quantization"


#: Output heads and embeddings stay in high precision unless the config says otherwise.
DEFAULT_EXCLUDE = ("lm_head", "embed_out", "output_layer", "embed_tokens", "word_embeddings", "wte", "wpe")


Backend = Literal[BACKENDS]


#: "e4m3" only with fmt "nvfp4" (its group scale codes, SPEC 3.4), where it is also the default.
ScaleFormat = Literal[ALL_SCALE_FORMATS]


Rounding = Literal[ROUNDINGS]


ComputeDtype = Literal[COMPUTE_DTYPE_NAMES]


#: "tensor": one scale per weight matrix; "channel": one per output row (SPEC 2).
Granularity = Literal[GRANULARITIES]


Activation = Literal[ACTIVATIONS]


def _check_fmt(value):
    if value is not None and value not in FORMATS and value not in PRESETS:
        raise ValueError(f"fmt={value!r} is not supported; allowed: {', '.join([*FORMATS, *PRESETS])}")
    return value


def _check_block(value):
    if value is not None and min(value) < 1:
        raise ValueError(f"block={value!r}: both block sizes must be >= 1")
    return value


def _check_patterns(patterns):
    return checks.check_regexes("module pattern", patterns)


class ModuleOverride(DeepSpeedConfigModel):
    """Per-pattern overrides; a field left out keeps the section's value."""

    enabled: Optional[bool] = None
    fmt: Optional[str] = None
    group_size: Optional[int] = Field(None, ge=1)
    block: Optional[Tuple[int, int]] = None
    granularity: Optional[Granularity] = None
    scale_format: Optional[ScaleFormat] = None
    rounding: Optional[Rounding] = None

    _fmt = field_validator("fmt")(_check_fmt)
    _block = field_validator("block")(_check_block)


class FPQuantizationConfig(DeepSpeedConfigModel):
    """Settings of :func:`ds_fpquant.apply` (docs/spec.md for the numerics of each field).

    ``group_size`` and ``scale_format`` left out mean 128 and ``"fp32"``, or a preset's own (G=32 and
    ``"e8m0"`` for MX, G=16 and e4m3 scale codes for ``"nvfp4"``); a preset refuses other given values.
    A ``modules`` override that sets ``fmt`` to a preset starts from the preset's own scaling: the
    section's ``group_size``, ``block`` and ``scale_format`` are not carried into it.

    ``granularity``: ``"tensor"`` (one scale per weight matrix, ``block=(WHOLE, WHOLE)``) or ``"channel"`` (one
    per output row, ``group_size=WHOLE``), instead of ``group_size`` / ``block`` (``WHOLE = 2**31 - 1``; a block
    or group side at least the matrix side means the whole side, SPEC 2). In a ``modules`` override, any of
    ``granularity``, ``group_size`` and ``block`` replaces the section's scaling.
    """

    enabled: bool = True
    fmt: str = "e4m3"
    group_size: Optional[int] = Field(None, ge=1)
    block: Optional[Tuple[int, int]] = None
    granularity: Optional[Granularity] = None
    scale_format: Optional[ScaleFormat] = None
    rounding: Rounding = "nearest"
    modules: Dict[str, ModuleOverride] = Field(default_factory=dict)
    exclude: List[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    backend: Backend = "auto"
    #: dtype the weight is dequantized to for the matmul; None: the activation's dtype.
    compute_dtype: Optional[ComputeDtype] = None
    #: None: weight-only (default). "e4m3": W8A8, activations quantized per token to e4m3 in groups of 128
    #: (opt-in: changes the numerics); every quantized module must then hold e4m3 weights with fp32 scales in
    #: groups of 128 or (128, 128) blocks (ds_fpquant.linear.linear).
    activation: Optional[Activation] = None

    _fmt = field_validator("fmt")(_check_fmt)

    @field_validator("exclude")
    @classmethod
    def _exclude_patterns(cls, value):
        return _check_patterns(value)

    @field_validator("modules")
    @classmethod
    def _module_patterns(cls, value):
        _check_patterns(value.keys())
        return value

    _block = field_validator("block")(_check_block)

    @model_validator(mode="after")
    def _presets_consistent(self):
        """Every combination a module can get (the section, each override) is valid for its ``fmt``."""
        for where, override in [("", None), *((f"modules[{p!r}].", o) for p, o in self.modules.items())]:
            try:
                self.settings(override)
            except ValueError as exc:
                raise ValueError(f"{where or 'fp_quantization.'}{exc}") from None
        return self

    def settings(self, override: Optional[ModuleOverride] = None) -> Dict[str, Any]:
        """Keyword arguments of :func:`ds_fpquant.quantize` of the section (``override``: with a ``modules``
        override applied): ``fmt``, ``group_size``, ``block``, ``scale_format`` (resolved; ``granularity`` as its
        block / group) and ``rounding``.

        Raises:
            ValueError: settings that contradict each other (see :func:`ds_fpquant.numerics.formats.resolve_scaling`)
                or W8A8 with weights it cannot take.
        """
        settings = dict(fmt=self.fmt, group_size=self.group_size, block=self.block, granularity=self.granularity,
                        scale_format=self.scale_format, rounding=self.rounding)
        if override is not None:
            given = {k: v for k, v in override.model_dump(exclude={"enabled"}).items() if v is not None}
            if given.get("fmt") in PRESETS:  # a preset brings its own scaling
                settings.update(group_size=None, block=None, granularity=None, scale_format=None)
            scaling = ("group_size", "block", "granularity")
            if any(key in given for key in scaling):  # the override's scaling replaces the section's
                settings.update({key: None for key in scaling})
            settings.update(given)
        fmt = settings["fmt"]
        settings["group_size"], settings["block"] = resolve_granularity(
            fmt, settings.pop("granularity"), settings["group_size"], settings["block"])
        settings["group_size"], settings["scale_format"], block = resolve_scaling(
            fmt, settings["group_size"], settings["block"], settings["scale_format"])
        if fmt not in PRESETS and settings["scale_format"] not in SCALE_FORMATS:
            raise ValueError(f"scale_format={settings['scale_format']!r} is only for fmt='nvfp4'; allowed for "
                             f"fmt={fmt!r}: 'fp32', 'e8m0'")
        if self.activation is not None:
            problem = w8a8_weight_problem(fmt, settings["scale_format"], settings["group_size"], block)
            if problem:
                raise ValueError(problem)
        return settings

    def settings_for(self, name: str) -> Optional[Dict[str, Any]]:
        """Keyword arguments of :func:`ds_fpquant.quantize` for the module ``name`` (``group_size`` and
        ``scale_format`` resolved), or ``None`` when it is not to be quantized (section disabled,
        excluded, or disabled by an override)."""
        if not self.enabled or any(re.search(p, name) for p in self.exclude):
            return None
        for pattern, override in self.modules.items():
            if re.search(pattern, name):
                return None if override.enabled is False else self.settings(override)
        return self.settings(None)


def read_ds_config(config) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as fh:
            return json.load(fh)
    if isinstance(config, Mapping):
        return config
    raise TypeError(f"ds_config must be a dict, a JSON file path or an FPQuantizationConfig, got "
                    f"{type(config).__name__}")


def load_config(config: Union[str, os.PathLike, Mapping[str, Any], FPQuantizationConfig]) -> FPQuantizationConfig:
    """The ``fp_quantization`` section from a full DeepSpeed config, the section alone, or a JSON path.

    Raises:
        TypeError: ``config`` is of another type.
        ValueError: no ``fp_quantization`` section, or an invalid one (pydantic's
            ``ValidationError`` is a ``ValueError``; its message names the field).
    """
    if isinstance(config, FPQuantizationConfig):
        return config
    data = read_ds_config(config)
    if SECTION in data:
        return FPQuantizationConfig(**data[SECTION])
    unknown = set(data) - set(FPQuantizationConfig.model_fields)
    if unknown:
        raise ValueError(f"ds_config has no {SECTION!r} section (top-level keys: {sorted(data)}); put the "
                         f"settings under {SECTION!r}")
    return FPQuantizationConfig(**data)


def split_config(config) -> Tuple[FPQuantizationConfig, Dict[str, Any]]:
    """(the ``fp_quantization`` section, the remaining DeepSpeed config keys)."""
    if config is None:
        return FPQuantizationConfig(), {}
    data = dict(read_ds_config(config))
    section = data.pop(SECTION, None)
    return FPQuantizationConfig(**(section or {})), data
