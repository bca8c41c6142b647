"""Argument checks shared by the native API and ``FP_Quantize`` (SPEC 7).

Every check raises before any kernel runs, with a message that names the parameter, the value
given and what is allowed.
"""

from __future__ import annotations

import operator
import re
from typing import Iterable

import numpy as np
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


def check_regexes(label: str, patterns) -> list:
    """Each of ``patterns`` (strings) must compile as a regular expression; ``ValueError`` names the first that does
    not (``f"{label} {pattern!r} is not a valid regular expression: ..."``). Returns ``patterns``."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{label} {pattern!r} is not a valid regular expression: {exc}") from None
    return patterns


def check_int(name: str, value, minimum: int) -> int:
    """``value`` must be an integer (``int``, numpy integer; not ``bool``) ``>= minimum``; returns it as ``int``."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} ({value!r})")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name}={value} is not allowed; it must be an int >= {minimum}")
    return value


def check_u64(name: str, value) -> int:
    """``value`` must be an integer in ``[0, 2^64)`` (a Philox key or counter); returns it as ``int``."""
    value = check_int(name, value, 0)
    if value >= 2**64:
        raise ValueError(f"{name}={value} is not allowed; it must be an int in [0, 2^64)")
    return value


def check_flag(name: str, value) -> bool:
    """``value`` must be a ``bool`` (or the ints 0 / 1 older callers pass); returns it as ``bool``."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def check_shape(name: str, value) -> tuple:
    """``value`` must be a sequence of ints >= 0 (a ``torch.Size`` or tuple); returns it as a tuple."""
    if not isinstance(value, (tuple, list, torch.Size)):
        raise TypeError(f"{name} must be a tuple of ints (a torch.Size), got {type(value).__name__} ({value!r})")
    return tuple(check_int(f"{name}[{i}]", d, 0) for i, d in enumerate(value))


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
