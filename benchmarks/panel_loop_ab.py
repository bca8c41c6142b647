"""A/B of the large-M CPU linear's panel loop: the previous C++ loop (a JIT build folder of an older build with
``linear(..., small_m, panel_bytes)``) against the Python one of ds_fpquant.linear.weight_only, in one process, bits
asserted equal. Results: benchmarks/results/panel_loop_ab_issue26.md."""

import glob
import importlib.util
import os
import statistics
import sys
import time

import torch

import ds_fpquant as fpq
from ds_fpquant.linear import weight_only as wo
from ds_fpquant.ops import backends

new, _ = backends.load_op("cpu")
old = None
for d in sorted(glob.glob(os.path.expanduser("~/.cache/torch_extensions/*/ds_fpquant_cpu_*")), key=os.path.getmtime, reverse=True):
    so = glob.glob(d + "/*.so")
    if not so: continue
    name = os.path.basename(d)
    spec = importlib.util.spec_from_file_location(name, so[0])
    try:
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    except Exception:
        continue
    if "panel_bytes" in (mod.linear.__doc__ or "") and hasattr(mod, "cpu_paths"):
        old = mod; print("old build:", name, mod.cpu_paths()); break
if old is None:
    sys.exit("no older JIT build with the C++ panel loop (linear(..., small_m, panel_bytes)) in ~/.cache/torch_extensions")
torch.manual_seed(0)
w = torch.randn(4096, 4096).bfloat16()
for fmt in ("e4m3", "e2m1"):
    qt = fpq.quantize(w, fmt)
    scales, kind, br, t = wo.scale_layout(qt); codes = wo._packed_codes(qt)
    for m in (64, 256):
        x = torch.randn(m, 4096).bfloat16()
        f_old = lambda: old.linear(x, codes, scales, kind, br, t, None, qt.format.name, qt.group_size, 4, wo.PANEL_BYTES)
        f_new = lambda: wo.weight_only_linear(x, qt, None, "cpu")
        assert torch.equal(f_old(), f_new()), "bits differ"
        res = {}
        for _ in range(3):
            for nm, f in (("C++ loop", f_old), ("Python loop", f_new)):
                ts = []
                for _ in range(7):
                    t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
                res.setdefault(nm, []).append(statistics.median(ts) * 1e3)
        print(fmt, m, {k: f"{min(v):.3f} ms" for k, v in res.items()})
