"""A short CUDA run for ``compute-sanitizer --tool memcheck``: every format and dtype through the
CUDA op on ragged, tiny, empty and misaligned inputs, stochastic rounding and E8M0 scales included, and
the GEMV of the quantized linear (1..8 rows of x, ragged groups, NVFP4 and 2-D blocks). Exits 0 when
every quantize/dequantize result equals the torch reference and every GEMV result is within the bound
of tests/unit/linear_bound.py."""

import dataclasses
import os
import sys

import torch

import ds_fpquant as fpq
from ds_fpquant.linear import linear

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from unit.linear_bound import assert_linear_within_bound  # noqa: E402


def main() -> int:
    bad = []
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(70_000, generator=gen)
    cases = [(base[:1], 128), (base[:7], 3), (base[:1000].view(10, 100), 32), (base[1:1 + 4 * 1537].view(4, 1537), 1537),
             (base[3:3 + 2 * 8192 + 5], 8192), (base[5:5 + 3 * 1536].view(3, 1536), 1536), (base[:0], 128)]
    for fmt in fpq.FORMATS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for x, g in cases:
                xd = x.to(dtype)
                for rounding, scale_format in (("nearest", "fp32"), ("stochastic", "fp32"), ("nearest", "e8m0")):
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
    for fmt, kwargs in [("e4m3", {"group_size": 128}), ("e2m1", {"group_size": 48}), ("e3m2", {"group_size": 7}),
                        ("nvfp4", {}), ("e4m3", {"block": (128, 128)})]:
        qt = fpq.quantize(torch.randn(19, 301, generator=gen), fmt, **kwargs)
        ts = None if qt.tensor_scale is None else qt.tensor_scale.cuda()
        qt_cuda = dataclasses.replace(qt, codes=qt.codes.cuda(), scales=qt.scales.cuda(), tensor_scale=ts)
        for m in (1, 5, 8):
            x = torch.randn(m, 301, generator=gen).to(torch.bfloat16)
            bias = torch.randn(19, generator=gen).to(torch.bfloat16)
            y = linear(x.cuda(), qt_cuda, bias.cuda())
            torch.cuda.synchronize()
            try:
                assert_linear_within_bound(x, qt, bias, y.cpu())
            except AssertionError as exc:
                bad.append((fmt, str(kwargs), m, f"GEMV: {exc}"))
    print(f"sanitize_run: {len(bad)} mismatching cases", bad[:10])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
