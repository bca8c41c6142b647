"""The ``"fp_quantization"`` section of a DeepSpeed config (pydantic, like DeepSpeed's own configs).

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
from pydantic import Field, field_validator

from .formats import FORMATS, PRESETS

#: The top-level key of the section in a DeepSpeed config.
SECTION = "fp_quantization"
#: Output heads and embeddings stay in high precision unless the config says otherwise.
DEFAULT_EXCLUDE = ("lm_head", "embed_out", "output_layer", "embed_tokens", "word_embeddings", "wte", "wpe")

Backend = Literal["auto", "cuda", "cpu", "torch"]
ScaleFormat = Literal["fp32", "e8m0"]
Rounding = Literal["nearest", "stochastic"]
ComputeDtype = Literal["fp32", "fp16", "bf16"]


def _check_fmt(value):
    if value is not None and value not in FORMATS and value not in PRESETS:
        raise ValueError(f"fmt={value!r} is not supported; allowed: {', '.join([*FORMATS, *PRESETS])}")
    return value


def _check_patterns(patterns):
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"module pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return patterns


class ModuleOverride(DeepSpeedConfigModel):
    """Per-pattern overrides; a field left out keeps the section's value."""

    enabled: Optional[bool] = None
    fmt: Optional[str] = None
    group_size: Optional[int] = Field(None, ge=1)
    block: Optional[Tuple[int, int]] = None
    scale_format: Optional[ScaleFormat] = None
    rounding: Optional[Rounding] = None

    _fmt = field_validator("fmt")(_check_fmt)


class FPQuantizationConfig(DeepSpeedConfigModel):
    """Settings of :func:`ds_fpquant.apply` (SPEC.md for the numerics of each field)."""

    enabled: bool = True
    fmt: str = "e4m3"
    group_size: int = Field(128, ge=1)
    block: Optional[Tuple[int, int]] = None
    scale_format: ScaleFormat = "fp32"
    rounding: Rounding = "nearest"
    modules: Dict[str, ModuleOverride] = Field(default_factory=dict)
    exclude: List[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    backend: Backend = "auto"
    #: dtype the weight is dequantized to for the matmul; None: the activation's dtype.
    compute_dtype: Optional[ComputeDtype] = None

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

    @field_validator("block")
    @classmethod
    def _block_positive(cls, value):
        if value is not None and min(value) < 1:
            raise ValueError(f"block={value!r}: both block sizes must be >= 1")
        return value

    def settings_for(self, name: str) -> Optional[Dict[str, Any]]:
        """Keyword arguments of :func:`ds_fpquant.quantize` for the module ``name``, or ``None``
        when it is not to be quantized (section disabled, excluded, or disabled by an override)."""
        if not self.enabled or any(re.search(p, name) for p in self.exclude):
            return None
        settings = dict(fmt=self.fmt, group_size=self.group_size, block=self.block,
                        scale_format=self.scale_format, rounding=self.rounding)
        for pattern, override in self.modules.items():
            if re.search(pattern, name):
                if override.enabled is False:
                    return None
                settings.update({k: v for k, v in override.model_dump(exclude={"enabled"}).items() if v is not None})
                break
        return settings


def _read(config) -> Mapping[str, Any]:
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
    data = _read(config)
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
    data = dict(_read(config))
    section = data.pop(SECTION, None)
    return FPQuantizationConfig(**(section or {})), data
