"""A short CUDA run for compute-sanitizer (``memcheck``, ``racecheck``, ``synccheck``; scripts/gpu_check.sh): the
quantize / dequantize kernels on every format and dtype on ragged, tiny, empty and misaligned inputs, stochastic
rounding and E8M0 scales included, then the GEMV of the quantized linear for every element format and scale layout
(fp32, E8M0, NVFP4, 2-D blocks) at M = 1, 8 and 16 with bf16, fp16 and fp32 x, on a layer of ragged groups (the padded
path) and on one whose few tiles split K (the cp.async ring, the split-K epilogue and its counters, called twice so
that the second call runs on the counters the first left). Exits 0 when every quantize/dequantize result equals the
torch reference and every GEMV result is within the bound of tests/unit/linear_bound.py.

``--tool`` only names the sanitizer in the output and trims the quantize cases for the slow tools (racecheck,
synccheck: one rounding mode per format and dtype); ``--part`` runs one half.
"""

import argparse
import dataclasses
import os
import sys

import torch

import ds_fpquant as fpq
from ds_fpquant.linear import linear

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from unit.linear_bound import assert_linear_within_bound  # noqa: E402

#: The GEMV's layers: (n, k, fmt, kwargs of quantize). 19 x 301: ragged groups, the padded path, one tile; 130 x 4096: three
#: tiles on an H200's 132 SMs, so K is split (8 splits) and the last block of each tile reduces and resets its counter.
GEMV_LAYERS = [(19, 301, "e4m3", {"group_size": 128}), (19, 301, "e2m1", {"group_size": 48}),
               (19, 301, "e3m2", {"group_size": 7}), (19, 301, "nvfp4", {}), (19, 301, "e4m3", {"block": (128, 128)})]
GEMV_LAYERS += [(130, 4096, fmt, {"group_size": 128}) for fmt in fpq.FORMATS]
GEMV_LAYERS += [(130, 4096, "e2m1", {"group_size": 32, "scale_format": "e8m0"}), (130, 4096, "nvfp4", {}),
                (130, 4096, "e4m3", {"block": (128, 128)})]
GEMV_ROWS = (1, 8, 16)
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_cases(gen: torch.Generator, thorough: bool) -> list:
    bad = []
    base = torch.randn(70_000, generator=gen)
    cases = [(base[:1], 128), (base[:7], 3), (base[:1000].view(10, 100), 32), (base[1:1 + 4 * 1537].view(4, 1537), 1537),
             (base[3:3 + 2 * 8192 + 5], 8192), (base[5:5 + 3 * 1536].view(3, 1536), 1536), (base[:0], 128)]
    modes = (("nearest", "fp32"), ("stochastic", "fp32"), ("nearest", "e8m0")) if thorough else (("stochastic", "e8m0"),)
    for fmt in fpq.FORMATS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for x, g in cases:
                xd = x.to(dtype)
                for rounding, scale_format in modes:
                    kw = dict(rounding=rounding, seed=7) if rounding == "stochastic" else {}
                    kw["scale_format"] = scale_format
                    got = fpq.quantize(xd.cuda(), fmt, g, backend="cuda", **kw)
                    ref = fpq.quantize(xd, fmt, g, backend="torch", **kw)
                    y = got.dequantize(backend="cuda")
                    torch.cuda.synchronize()
                    same = (torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
                            and torch.equal(y.cpu(), ref.dequantize(backend="torch")))
                    if not same:
                        bad.append((fmt, str(dtype), tuple(x.shape), g, rounding, scale_format))
    return bad


def gemv_cases(gen: torch.Generator) -> list:
    bad = []
    for n, k, fmt, kwargs in GEMV_LAYERS:
        qt = fpq.quantize(torch.randn(n, k, generator=gen), fmt, **kwargs)
        ts = None if qt.tensor_scale is None else qt.tensor_scale.cuda()
        qt_cuda = dataclasses.replace(qt, codes=qt.codes.cuda(), scales=qt.scales.cuda(), tensor_scale=ts)
        for dtype in GEMV_DTYPES:
            for m in GEMV_ROWS:
                x = torch.randn(m, k, generator=gen).to(dtype)
                bias = torch.randn(n, generator=gen).to(dtype)
                for call in range(2):  # the second call finds the split-K counters as the first left them
                    y = linear(x.cuda(), qt_cuda, bias.cuda())
                    torch.cuda.synchronize()
                    try:
                        assert_linear_within_bound(x, qt, bias, y.cpu())
                    except AssertionError as exc:
                        bad.append((fmt, n, k, str(kwargs), str(dtype), m, call, f"GEMV: {exc}"))
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", default="memcheck", choices=("memcheck", "racecheck", "synccheck", "none"))
    parser.add_argument("--part", default="all", choices=("all", "quantize", "gemv"))
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    bad = []
    if args.part in ("all", "quantize"):
        bad += quantize_cases(gen, thorough=args.tool in ("memcheck", "none"))
    if args.part in ("all", "gemv"):
        bad += gemv_cases(gen)
    print(f"sanitize_run ({args.tool}, {args.part}): {len(bad)} mismatching cases", bad[:10])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
