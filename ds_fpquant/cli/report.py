"""``ds-fpquant report [--build]``: DeepSpeed's op report (``ds_report``) with this project's ops.

The two builders are added to DeepSpeed's op table for the duration of the report, so their rows
read like DeepSpeed's own: *installed* means prebuilt (``DS_BUILD_FPQUANT[_CPU]=1 pip install``),
*compatible* means it can be JIT-built here. Then come the reason for each op that is not
compatible, and which backend each public function uses on each device. ``--build`` JIT-builds
each compatible op and checks it bit for bit against the torch reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Dict, List, Tuple

import torch

from ds_fpquant.numerics.formats import FORMATS


def _builders() -> Dict[str, object]:
    from ds_fpquant.op_builder.fp_quantizer import FPQuantizerBuilder
    from ds_fpquant.op_builder.fp_quantizer_cpu import FPQuantizerCPUBuilder

    return {b.NAME: b for b in (FPQuantizerBuilder(), FPQuantizerCPUBuilder())}


def _prebuilt(builder) -> bool:
    try:
        return importlib.util.find_spec(builder.absolute_name()) is not None
    except ModuleNotFoundError:
        return False


def deepspeed_report(builders: Dict[str, object]) -> None:
    """DeepSpeed's ``env_report.main`` with ``builders`` in its op table (restored afterwards)."""
    from deepspeed import env_report

    added = [name for name in builders if name not in env_report.ALL_OPS]
    saved_installed = {name: env_report.installed_ops.get(name) for name in builders}
    env_report.ALL_OPS.update(builders)
    for name, builder in builders.items():
        env_report.installed_ops[name] = _prebuilt(builder)
    try:
        env_report.main(hide_operator_status=False, hide_errors_and_warnings=True)
    finally:
        for name in added:
            env_report.ALL_OPS.pop(name, None)
        for name, value in saved_installed.items():
            if value is None:
                env_report.installed_ops.pop(name, None)
            else:
                env_report.installed_ops[name] = value


def self_test(module, device: str) -> Tuple[bool, str]:
    """Every format, RNE and stochastic, through the op's kernels on ``device`` vs the torch reference."""
    from ds_fpquant.tensor.quantize import quantize

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 301, generator=gen) * 3
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    for fmt in FORMATS:
        for stochastic in (False, True):
            ref = quantize(x, fmt, 64, backend="torch", **(dict(rounding="stochastic", seed=5) if stochastic else {}))
            codes, scales = module.quantize(x.to(device), fmt, 64, None, stochastic, 5 if stochastic else 0, 0)
            y = module.dequantize(codes, scales, x.shape[1], fmt, 64, torch.float32)
            same_values = torch.allclose(y.cpu(), ref.dequantize(backend="torch"), rtol=0, atol=0, equal_nan=True)
            same_scales = torch.allclose(scales.cpu(), ref.scales, rtol=0, atol=0, equal_nan=True)
            if not (torch.equal(codes.cpu(), ref.codes) and same_scales and same_values):
                return False, f"{fmt} ({'stochastic' if stochastic else 'nearest'}) differs from the torch reference"
    return True, f"all {len(FORMATS)} formats bit-exact on {device}"


def cpu_target(builder) -> str:
    """The CPU op's target flag, the DS_FPQUANT_CPU_ARCH setting it comes from and the build folder, or why
    the setting names no target."""
    from ds_fpquant.op_builder.builder import CPU_ARCH_VAR

    setting = f"{CPU_ARCH_VAR}={os.environ.get(CPU_ARCH_VAR, '') or 'unset'}"
    try:
        return f"CPU target: {builder.cpu_arch()} ({setting}), build folder {builder.build_name()}"
    except ValueError as exc:
        return f"CPU target: none ({exc})"


def build_and_test(builders: Dict[str, object]) -> List[Tuple[str, bool, str]]:
    """(op name, passed, detail) for each op: JIT-build (or import) it and self-test it."""
    rows = []
    for name, builder in builders.items():
        if not builder.is_compatible(verbose=False):
            rows.append((name, False, f"SKIP (not compatible: {builder.error_log})"))
            continue
        t0 = time.perf_counter()
        try:
            module = builder.load(verbose=False)
        except Exception as exc:  # report, do not crash: the report is a diagnosis tool
            rows.append((name, False, f"FAIL build: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"))
            continue
        seconds = time.perf_counter() - t0
        device = "cuda" if getattr(module, "WITH_CUDA", False) and torch.cuda.is_available() else "cpu"
        ok, detail = self_test(module, device)
        paths = ", ".join(module.cpu_paths()) or "none (portable loops)"
        rows.append((name, ok, f"{'PASS' if ok else 'FAIL'} ({detail}; CPU kernels' AVX-512 paths: {paths}; "
                               f"load {seconds:.1f} s)"))
    return rows


#: The public functions that pick a backend, and where the choice happens (all through backends.resolve).
PUBLIC_FUNCTIONS = ("quantize", "dequantize", "FP_Quantize.quantize / dequantize / selective_dequantize",
                    "FPQuantizedLinear.forward (apply, init_inference)")


def backend_table() -> List[str]:
    """Which backend each public function uses with ``backend='auto'`` on each device, and why."""
    from ds_fpquant.ops import backends

    choices = {}
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            choices[device] = "no CUDA device visible"
            continue
        try:
            module, reason = backends.load_op(device)
        except ValueError as exc:  # BuildSettingError: a setting names no build; every call on this device raises it
            choices[device] = f"none: each call raises ValueError: {exc}"
            continue
        choices[device] = f"compiled {device} op" if module is not None else f"torch reference, because: {reason}"
    lines = []
    for name in PUBLIC_FUNCTIONS:
        lines.append(name)
        for device, choice in choices.items():
            lines.append(f"    {device} tensors {'.' * (8 - len(device))} {choice}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ds-fpquant report", description="DeepSpeed's op report with the "
                                     "ds_fpquant ops added; --build builds and self-tests them.")
    parser.add_argument("--build", action="store_true", help="JIT-build each compatible op and self-test it")
    args = parser.parse_args(argv)
    builders = _builders()
    deepspeed_report(builders)
    print("-" * 50)
    print("ds_fpquant ops")
    for name, builder in builders.items():
        compatible = builder.is_compatible(verbose=False)
        why = "" if compatible else f": {builder.error_log}"
        print(f"{name} {'.' * (22 - len(name))} installed: {'yes' if _prebuilt(builder) else 'no'}, "
              f"compatible: {'yes' if compatible else 'no'}{why}")
        if builder.BUILD_VAR == "DS_BUILD_FPQUANT_CPU":
            print(f"{'':23} {cpu_target(builder)}")
    failed = False
    if args.build:
        print("-" * 50)
        for name, _ok, detail in build_and_test(builders):
            print(f"{name} {'.' * (22 - len(name))} {detail}")
            failed |= detail.startswith("FAIL")
    print("-" * 50)
    print("backend each public function uses (backend='auto'; 'cpu' / 'cuda' / 'torch' choose explicitly)")
    for line in backend_table():
        print(line)
    return 1 if failed else 0
