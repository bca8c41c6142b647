"""Argument checks shared by the native API and ``FP_Quantize`` (SPEC 7).

Every check raises before any kernel runs, with a message that names the parameter, the value
given and what is allowed.
"""

from __future__ import annotations

from typing import Iterable

import torch

#: Input / output dtypes every backend accepts (SPEC 7).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(allowed: Iterable) -> str:
    return ", ".join(repr(a) if isinstance(a, str) else str(a) for a in allowed)


def check_choice(name: str, value, allowed) -> None:
    """``value`` must be one of ``allowed`` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} ({value!r}); allowed: {_names(allowed)}")
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {_names(allowed)}")


def check_int(name: str, value, minimum: int) -> None:
    """``value`` must be an ``int`` (not ``bool``) and ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name}={value} is not allowed; it must be an int >= {minimum}")


def check_tensor(name: str, value) -> None:
    """``value`` must be a ``torch.Tensor`` of a supported floating dtype."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    check_float_dtype(name + ".dtype", value.dtype)


def check_float_dtype(name: str, dtype) -> None:
    """``dtype`` must be one of fp32 / fp16 / bf16."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}={dtype} is not supported; allowed: {_names(FLOAT_DTYPES)}")


def check_byte_tensor(name: str, value, shape=None, device=None) -> None:
    """``value`` must be a uint8 or int8 tensor, optionally of ``shape`` and on ``device``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint8 or int8, got {type(value).__name__}")
    if value.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"{name}.dtype={value.dtype} is not supported; allowed: torch.uint8, torch.int8")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected {tuple(shape)}")
    check_device(name, value, device)


def check_device(name: str, value: torch.Tensor, device) -> None:
    """``value`` must live on ``device`` (skipped when ``device`` is None)."""
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} is on {value.device}; expected {device}")
