"""``ds-fpquant bench`` runs and reports every backend next to its baselines (no timing asserts)."""

import json
import subprocess
import sys

import torch

from ds_fpquant.cli.bench import ops as bench


def test_bench_rows_and_ratios():
    results = bench.run(torch.device("cpu"), [0.25], ["e4m3", "e2m1"], [128], repeat=1, warmup=1, progress=False)
    impls = {(r.op, r.impl, r.fmt) for r in results}
    for op in ("quantize", "dequantize"):
        for impl in ("cpu", "torch"):
            assert (op, impl, "e4m3") in impls and (op, impl, "e2m1") in impls
        assert (op, "torch composite", "e4m3") in impls
        assert (op, "torch composite", "e2m1") not in impls  # torch has no FP4 dtype to cast to
    assert ("copy", "torch copy_", "-") in impls and ("cast", "torch .to(float8)", "e4m3") in impls
    ours = next(r for r in results if (r.op, r.impl, r.fmt) == ("quantize", "cpu", "e4m3"))
    assert ours.ms > 0 and ours.gbps > 0 and ours.vs_composite > 0 and ours.vs_cast > 0 and ours.vs_copy > 0
    table = bench.format_table(results)
    assert table.count("\n") == len(results) + 1


def test_bench_cli_json(tmp_path):
    path = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--sizes", "0.25", "--formats", "e5m2",
                          "--group-sizes", "64", "--repeat", "1", "--json", str(path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(path.read_text())
    assert data["environment"]["device"] == "cpu" and data["results"]
    assert "| quantize | cpu | e5m2 | 64 |" in run.stdout


def test_selective_dequantize_benchmark_script():
    """benchmarks/selective_dequantize.py runs, checks its own bits and prints both rows (no timing asserts)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[4] / "benchmarks" / "selective_dequantize.py"
    run = subprocess.run([sys.executable, str(script), "--experts", "6", "--rows", "8", "--cols", "24", "--top-k", "2",
                          "--group-size", "20", "--q-bits", "6", "--repeat", "1", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| 6 | dequantize (all experts) |" in run.stdout and "| 6 | selective_dequantize (k=2) |" in run.stdout
    bad = subprocess.run([sys.executable, str(script), "--top-k", "9", "--experts", "4"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "--top-k=9 is more than --experts=4" in bad.stderr


def test_bench_linear_quick_rows():
    """``ds-fpquant bench --linear --quick``: every impl row of every format, resident and model-sized."""
    run = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--linear", "--quick", "--repeat", "1",
                          "--tokens", "1", "9", "--linear-formats", "e4m3", "nvfp4"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for impl in ("nn.Linear fp32 | -", "nn.Linear bf16 | -", "dequantize + matmul | e4m3", "fused | e4m3",
                 "dequantize + matmul | nvfp4", "fused | nvfp4"):
        for m in (1, 9):
            assert f"| 512x512 | {m} | {impl} |" in run.stdout, run.stdout
    assert "| 512x512 | - | copy_ bf16 weights |" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--linear", "--linear-formats", "fp8"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "fmt='fp8' is not supported" in bad.stderr


def test_llc_is_read_from_every_cache_entry(tmp_path):
    """sysfs lists ``uevent`` beside ``index0..3``; it made the whole read fail on some machines (the bench then
    sized its model-sized pass for a 260 MiB fallback instead of the real L3)."""
    from ds_fpquant.cli.bench.linear import FALLBACK_LLC_MIB, llc_bytes

    (tmp_path / "uevent").write_text("")
    for i, size in enumerate(["48K", "32K", "2048K", "32768K"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()  # an entry without a size is skipped
    assert llc_bytes(str(tmp_path)) == 32 * 2**20
    assert llc_bytes(str(tmp_path / "missing")) == FALLBACK_LLC_MIB * 2**20
