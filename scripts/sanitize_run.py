"""A short CUDA run for ``compute-sanitizer --tool memcheck``: every format and dtype through the
CUDA op on ragged, tiny, empty and misaligned inputs, stochastic rounding and E8M0 scales included. Exits 0 when
every result also equals the torch reference."""

import sys

import torch

import ds_fpquant as fpq


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
    print(f"sanitize_run: {len(bad)} mismatching cases", bad[:10])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
