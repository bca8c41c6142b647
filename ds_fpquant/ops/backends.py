"""Backend selection: the compiled ops (DeepSpeed op builders) and the torch reference.

``"auto"`` uses the compiled op for the tensor's device when it builds and loads, and falls back
to the torch implementation otherwise, with one warning per process saying why. ``"cpu"`` and
``"cuda"`` ask for a compiled op explicitly and raise when it cannot be had.
"""

from __future__ import annotations

import threading
import warnings
from typing import Dict, Optional, Tuple

import torch

__all__ = ["resolve", "load_op", "op_status", "TORCH"]

#: Name of the torch reference backend.
TORCH = "torch"


_lock = threading.Lock()


_ops: Dict[str, Tuple[Optional[object], str]] = {}  # backend -> (module or None, reason)


_warned: Dict[str, bool] = {}


def _builder(backend: str):
    if backend == "cpu":
        from ds_fpquant.op_builder.fp_quantizer_cpu import FPQuantizerCPUBuilder
        return FPQuantizerCPUBuilder()
    from ds_fpquant.op_builder.fp_quantizer import FPQuantizerBuilder
    return FPQuantizerBuilder()


def load_op(backend: str) -> Tuple[Optional[object], str]:
    """(compiled module, '') for ``"cpu"``/``"cuda"``, or (None, why it is not available).

    The first call builds (JIT) or imports the op; the result, success or failure, is cached (later calls
    read the cache without taking the lock).

    Raises:
        ValueError: the build settings are invalid (``DS_FPQUANT_CPU_ARCH`` is no target the compiler knows);
            nothing is cached, so a corrected setting takes effect on the next call.
    """
    from ds_fpquant.op_builder.builder import BuildSettingError

    cached = _ops.get(backend)
    if cached is not None:
        return cached
    with _lock:
        if backend not in _ops:
            try:
                builder = _builder(backend)
                if not builder.is_compatible(verbose=False):
                    _ops[backend] = (None, builder.error_log or f"{builder.NAME} is not compatible with this system")
                else:
                    _announce_build(builder)
                    _ops[backend] = (builder.load(verbose=False), "")
            except BuildSettingError:  # a setting that names no build (DS_FPQUANT_CPU_ARCH): the caller's to fix
                raise
            except Exception as exc:  # a failed build must not break the torch fallback
                _ops[backend] = (None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}")
        return _ops[backend]


def _announce_build(builder) -> None:
    """One stderr line when the op is about to be JIT-built: not prebuilt, and not yet built from
    these sources (the build folder is named after their hash, ``builder.build_name()``)."""
    import importlib.util
    import os
    import sys

    try:
        prebuilt = importlib.util.find_spec(builder.absolute_name()) is not None
    except ModuleNotFoundError:
        prebuilt = False
    if prebuilt:
        return
    build_dir = builder.build_directory()
    if not os.path.exists(os.path.join(build_dir, f"{builder.build_name()}.so")):
        print(f"ds_fpquant: building the {builder.NAME} op (first use from these sources; cached in {build_dir})...",
              file=sys.stderr, flush=True)


def op_status(backend: str) -> str:
    """'' when the compiled op for ``backend`` is available, else the reason."""
    return load_op(backend)[1]


def resolve(backend: str, device: torch.device):
    """The backend to run on ``device`` for ``backend``: a compiled module, or :mod:`ds_fpquant.ops.torch_backend`
    (the torch reference). All have the same ``quantize`` / ``dequantize`` / ``linear`` functions.

    Raises:
        ValueError: ``backend`` names a device the tensor is not on.
        RuntimeError: an explicitly requested compiled op cannot be built or loaded.
    """
    from ds_fpquant.ops import torch_backend

    if backend == TORCH:
        return torch_backend
    if backend in ("cpu", "cuda"):
        if device.type != backend:
            raise ValueError(f"backend={backend!r} needs a {backend} tensor; the input is on {device}")
        module, reason = load_op(backend)
        if module is None:
            raise RuntimeError(f"backend={backend!r}: the compiled op is not available: {reason}")
        return module
    if device.type not in ("cpu", "cuda"):
        _warn_once(device.type, f"no compiled op for {device.type} tensors")
        return torch_backend
    module, reason = load_op(device.type)
    if module is None:
        _warn_once(device.type, reason)
        return torch_backend
    return module


def _warn_once(key: str, reason: str) -> None:
    if not _warned.get(key):
        _warned[key] = True
        warnings.warn(f"ds_fpquant: using the torch backend for {key} tensors: {reason}", RuntimeWarning,
                      stacklevel=4)
