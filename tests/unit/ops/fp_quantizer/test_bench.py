"""``ds-fpquant bench`` runs and reports every backend next to its baselines (no timing asserts)."""

import json
import platform
import subprocess
import sys

import pytest
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


def test_bench_linear_quick_rows(tmp_path):
    """``ds-fpquant bench --linear --quick``: every impl row of every format (fused with bf16 and fp32 x), resident
    and model-sized, the read bandwidth, the two torch peers (checked against ``x @ dequant(W)^T`` before timing),
    GB/s of every weight row, the issue's summary tables, the JSON fields and the ``--results`` file pair."""
    path = tmp_path / "linear.json"
    stem = tmp_path / "results" / "linear_quick"
    args = [sys.executable, "-m", "ds_fpquant", "bench", "--linear", "--quick", "--repeat", "1", "--tokens", "1", "9",
            "--linear-formats", "e4m3", "nvfp4", "--with-dequantize", "--json", str(path), "--results", str(stem)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for impl in ("nn.Linear fp32 | - | fp32", "nn.Linear bf16 | - | bf16", "torch int8pack | int8 per channel | bf16",
                 "torch int4pack | int4 g128 | bf16", "dequantize + matmul | e4m3 | bf16", "fused | e4m3 | bf16",
                 "fused | e4m3 | fp32", "dequantize + matmul | nvfp4 | bf16", "fused | nvfp4 | bf16",
                 "fused | nvfp4 | fp32"):
        for m in (1, 9):
            assert f"| 512x512 | {m} | {impl} |" in run.stdout, run.stdout
    assert "| 512x512 | - | copy_ bf16 weights |" in run.stdout
    assert "| - | - | read bandwidth (fp32 sum) | - |" in run.stdout
    assert ("| M | bf16 F.linear | torch int8pack | torch int4pack g128 | ds_fpquant e4m3 g128 | "
            "ds_fpquant nvfp4 g16 |") in run.stdout
    assert "| M | bf16 F.linear (0.50 MiB) | torch int8pack (0.25 MiB) | torch int4pack g128 (0.13 MiB) |" in run.stdout
    assert "| M | fp32 F.linear | ds_fpquant e4m3 g128 (fp32 x) | ds_fpquant nvfp4 g16 (fp32 x) |" in run.stdout
    assert "Roofline of this run: read bandwidth " in run.stdout
    assert "| impl | x | peak of its roofline (what it runs) | GFLOP/s |" in run.stdout
    data = json.loads(path.read_text())
    env, rows = data["environment"], data["results"]
    assert env["read_gbps"] > 0 and env["read_mib"] >= 64 and env["llc_multiple"] == 4 and env["cpu"]
    assert env["cores"] >= 1 and env["machine_llc_mib"] > 0 and env["llc_mib"] == 1 and env["run_s"] > 0
    assert env["threads"] >= 1 and "cpu_features" in env and env["torch_cpu_capability"] and "op_cpu_paths" in env
    assert env["read_gbps"] == max(env["read_gbps_start_end"]) and "steal_s" in env
    for kind, both in env["peak_gflops_start_end"].items():
        assert env["peak_gflops"][kind] == max(both)
    from ds_fpquant.cli.bench.roofline import cpu_flags

    if platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags():
        assert env["peak_gflops"]["fp32_fma_ymm"] > 0 and "avx2 fma" in env["cpu_features"]
        assert env["peak_instructions"]["fp32_fma_ymm"] == "vfmadd231ps ymm"
    for r in rows:
        if not r["m"]:
            continue
        assert r["macs"] == r["m"] * 512 * 512 and r["bound"] in ("memory", "compute") and r["peak"]
        assert r["layers"] * r["weight_bytes"] >= 4 * 2**20  # every kind's pass reads 4 "caches" of its own bytes
        assert r["passes"] >= 1 and (r["resident_ms"] is None) == (r["resident_calls"] == 0)
        memory = r["weight_bytes"] / env["read_gbps"] / 1e6
        compute = 0 if r["peak_gflops"] is None else 2 * r["macs"] / r["peak_gflops"] / 1e6
        assert r["roofline_ms"] == pytest.approx(max(memory, compute), rel=1e-2)  # read_gbps is rounded in env
        assert r["of_roofline"] == pytest.approx(r["roofline_ms"] / r["model_ms"], rel=1e-12)
    read = rows[0]
    assert read["impl"] == "read bandwidth (fp32 sum)" and read["of_read_bw"] == 1.0
    by_key = {(r["m"], r["impl"], r["fmt"], r["x"]): r for r in rows}
    assert len(by_key) == len(rows)
    for m in (1, 9):
        for key in (("torch int8pack", "int8 per channel"), ("torch int4pack", "int4 g128")):
            row = by_key[(m, *key, "bf16")]
            assert 0 <= row["peer_check"] <= 1 and row["model_gbps"] > 0 and row["of_read_bw"] > 0
        fused = by_key[(m, "fused", "e4m3", "bf16")]
        assert fused["label"] == "ds_fpquant e4m3 g128" and fused["peer_check"] is None
        assert fused["weight_bytes"] == 512 * 512 + 512 * 4 * 4  # codes + fp32 scales, G=128
        assert by_key[(m, "torch int8pack", "int8 per channel", "bf16")]["weight_bytes"] == 512 * 512 + 512 * 2
        assert by_key[(m, "torch int4pack", "int4 g128", "bf16")]["weight_bytes"] == 512 * 256 + 4 * 512 * 2 * 2
        assert abs(fused["model_gbps"] - fused["weight_bytes"] / fused["model_ms"] / 1e6) < 1e-9
        fused32 = by_key[(m, "fused", "e4m3", "fp32")]
        assert fused32["label"] == "ds_fpquant e4m3 g128 (fp32 x)"
        base32 = by_key[(m, "nn.Linear fp32", "-", "fp32")]
        assert abs(fused32["model_vs_fp32"] - base32["model_ms"] / fused32["model_ms"]) < 1e-9
    md = (tmp_path / "results" / "linear_quick.md").read_text()
    saved = json.loads((tmp_path / "results" / "linear_quick.json").read_text())
    assert md.startswith("# ds-fpquant bench --linear, ") and "--linear-formats e4m3 nvfp4" in md
    assert "| M | bf16 F.linear | torch int8pack |" in md and "| 512x512 | 9 | fused | nvfp4 | fp32 |" in md
    assert f"- cores: {env['cores']}" in md and "MiB last-level cache" in md.splitlines()[0]
    assert saved["command"].startswith("ds-fpquant bench --linear") and saved["date"]
    assert saved["environment"]["cpu"] == env["cpu"] and len(saved["results"]) == len(rows)
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already exist" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--linear", "--linear-formats", "fp8"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "fmt='fp8' is not supported" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--linear", "--llc-multiple", "0"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--llc-multiple must be > 0" in bad.stderr


def test_results_paths():
    """``--results NAME`` lands in benchmarks/results/ of the folder the command runs in; a name with a folder is
    used as given; a .md / .json ending is not doubled."""
    import os

    from ds_fpquant.cli.common import results_paths

    assert results_paths("linear_cpu") == (os.path.join("benchmarks", "results", "linear_cpu.md"),
                                          os.path.join("benchmarks", "results", "linear_cpu.json"))
    assert results_paths("out/run.md") == ("out/run.md", "out/run.json")
    assert results_paths("/tmp/a.json") == ("/tmp/a.md", "/tmp/a.json")


def test_bench_linear_without_peers_and_odd_shapes():
    """``run`` straight: ``with_peers=False`` leaves both peers out; a shape int4pack cannot pack (K not a multiple
    of 128) keeps the int8 peer and says why the int4 one is missing; the summary has one column per row kind."""
    from ds_fpquant.cli.bench import linear as bench_linear

    rows = bench_linear.run([(64, 96)], [2], ["e2m1"], repeat=1, llc=2**16, progress=False, read_bytes=2**20,
                            x_dtypes=["bf16"])
    impls = [r.impl for r in rows if r.m]
    assert "torch int8pack" in impls and "torch int4pack" not in impls and "fused" in impls
    assert "dequantize + matmul" not in impls and not any(r.x == "fp32" and r.impl == "fused" for r in rows)
    summary = bench_linear.format_summary(rows)
    assert "| M | bf16 F.linear | torch int8pack | ds_fpquant e2m1 g128 |" in summary
    assert "fp32 x" not in summary  # no fused fp32-x rows: no fp32 table
    none = bench_linear.run([(64, 128)], [1], ["e4m3"], repeat=1, llc=2**16, progress=False, read_bytes=2**20,
                            with_peers=False)
    assert not any(r.impl.startswith("torch") for r in none)
    assert none[0].impl == bench_linear.READ_IMPL and none[0].weight_bytes == 2**20


def test_peer_kernels_are_x_times_their_dequantized_weights():
    """The peers compute ``x @ dequant(W)^T`` for their own int quantization (within check_peer's bound) for bf16,
    fp16 and fp32 ``x``; the layout mistakes one could make with ``scales_and_zeros`` are caught far above it; the
    int4 codes the packing keeps are the ones quantized (unpacked as torch's inductor does, x = I, scale 1,
    zero 8)."""
    from ds_fpquant.cli.bench import peers

    torch.manual_seed(0)
    for n, k in ((48, 256), (256, 384)):
        w = torch.randn(n, k) * 0.02
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            p8 = peers.int8pack_weight(w, dtype, keep_dequantized=True)
            p4 = peers.int4pack_weight(w, dtype, keep_dequantized=True)
            assert p8.scales.shape == (n,) and p8.scales.dtype == dtype and p8.packed.dtype == torch.int8
            assert p4.scales.shape == (k // 128, n, 2) and p4.scales.dtype == dtype
            for m in (1, 3, 17):
                x = torch.randn(m, k).to(dtype)
                assert peers.check_peer(x, p8) <= 1 and peers.check_peer(x, p4) <= 1
        # the quantization is a fair one: the dequantized weights are near the masters
        assert (p8.dequantized - w.double()).abs().max() <= w.abs().max() / 127
        assert (p4.dequantized - w.double()).abs().max() <= (w.abs().max() * 2 / 15) * 0.6
        x = torch.randn(5, k).bfloat16()
        p4 = peers.int4pack_weight(w, keep_dequantized=True)
        scale, zero = p4.scales[..., 0].clone(), p4.scales[..., 1].clone()
        wrong = {"scale and zero swapped": torch.stack([zero, scale], -1),
                 "zero without the 8 * scale offset": torch.stack([scale, zero - 8 * scale], -1),
                 "groups in reverse order": p4.scales.flip(0)}
        for what, sz in wrong.items():
            bad = peers.PeerWeight("int4pack", p4.packed, sz.contiguous(), p4.shape, 128, p4.dequantized)
            assert peers.check_peer(x, bad) > 4, what
        bad8 = peers.PeerWeight("int8pack", p8.packed, p8.scales.flip(0).contiguous(), p8.shape, 0, p8.dequantized)
        assert peers.check_peer(x.to(p8.scales.dtype), bad8) > 4
        unit = torch.tensor([1.0, 8.0]).bfloat16().expand(k // 128, n, 2).contiguous()
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k).bfloat16(), p4.packed, 128, unit)
        deq = p4.dequantized.view(n, k // 128, 128)
        sz = p4.scales.double().transpose(0, 1)
        q = ((deq - sz[..., 1:]) / sz[..., :1] + 8).round().view(n, k)
        assert torch.equal(codes.T.double(), q)
    with pytest.raises(ValueError, match="multiple of its group size 128"):
        peers.int4pack_weight(torch.randn(16, 100))
    with pytest.raises(ValueError, match="keep_dequantized"):
        peers.check_peer(torch.randn(1, 128).bfloat16(), peers.int8pack_weight(torch.randn(16, 128)))


def test_peer_linear_module_runs_the_peer_op():
    """``PeerLinear`` (the generate bench's stand-in) gives the peer op's output for 3-D ``x``, with the bias."""
    from ds_fpquant.cli.bench import peers

    torch.manual_seed(1)
    lin = torch.nn.Linear(256, 32, bias=True).bfloat16()
    x = torch.randn(2, 3, 256).bfloat16()
    for kind in ("int8pack", "int4pack"):
        module = peers.PeerLinear(lin, kind)
        p = peers.PeerWeight(kind, module.packed, module.scales, torch.Size((32, 256)), module.group_size)
        want = peers.peer_linear(x.reshape(6, 256), p).view(2, 3, 32) + lin.bias
        assert torch.equal(module(x), want) and module.nbytes == p.nbytes


def test_bench_generate_quick(tmp_path):
    """``ds-fpquant bench --generate --quick``: a tiny random Llama, every row at both batch sizes, the table, the
    JSON fields; torchao's row is skipped with the reason where torchao is not importable (no timing asserts)."""
    path = tmp_path / "generate.json"
    run = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--generate", "--quick", "--repeat", "1",
                          "--new-tokens", "3", "--prefill-tokens", "6", "--json", str(path), "--results",
                          str(tmp_path / "gen")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    md = (tmp_path / "gen.md").read_text()
    assert md.startswith("# ds-fpquant bench --generate, ") and "Llama (random, bf16): hidden 256" in md
    assert "| 2 | ds_fpquant e2m1 g128 |" in md and json.loads((tmp_path / "gen.json").read_text())["results"]
    assert "Llama (random, bf16): hidden 256, 2 layers" in run.stdout and "14 linears converted" in run.stdout
    labels = ("bf16", "ds_fpquant e4m3 g128", "ds_fpquant e2m1 g128", "ds_fpquant nvfp4 g16", "torch int8pack",
              "torch int4pack g128")
    for b in (1, 2):
        for label in labels:
            assert f"| {b} | {label} |" in run.stdout, run.stdout
    data = json.loads(path.read_text())
    env, rows = data["environment"], data["results"]
    assert env["llama_hidden_size"] == 256 and env["new_tokens"] == 3 and env["prompt_tokens"] == 4
    assert env["prefill_tokens"] == 6 and "prefill tokens/s: one forward over batch x 6 prompt tokens" in run.stdout
    assert "| first token s | prefill tokens/s | vs bf16 | decode tokens/s | vs bf16 |" in run.stdout
    assert env["linears_converted"] == 14 and env["parameters"] > 0 and env["cores"] >= 1 and env["llc_mib"] > 0
    try:
        import torchao.quantization  # noqa: F401
        has_torchao = True
    except Exception:
        has_torchao = False
    if has_torchao:
        assert any(r["fmt"] == "torchao-int8" for r in rows)
    else:
        assert "torchao is not importable" in env["skipped"]["torchao-int8"]
        assert "torchao-int8: skipped" in run.stdout
    assert [r["batch"] for r in rows] == sorted(r["batch"] for r in rows)
    bf16 = {r["batch"]: r for r in rows if r["fmt"] == "bf16"}
    for r in rows:
        assert r["new_tokens"] == 3 and r["generate_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["prefill_s"] < r["generate_s"] and r["decode_tokens_per_s"] > 0
        assert abs(r["vs_bf16"] - r["tokens_per_s"] / bf16[r["batch"]]["tokens_per_s"]) < 1e-9
        assert r["prefill_tokens"] == 6 and r["prefill_forward_s"] > 0
        assert r["prefill_tokens_per_s"] == pytest.approx(r["batch"] * 6 / r["prefill_forward_s"], rel=1e-12)
        assert r["prefill_vs_bf16"] == pytest.approx(
            r["prefill_tokens_per_s"] / bf16[r["batch"]]["prefill_tokens_per_s"], rel=1e-12)
        assert (r["converted_linears"] == 0) == (r["fmt"] == "bf16")
        assert r["linear_mib"] < bf16[r["batch"]]["linear_mib"] or r["fmt"] == "bf16"
    bad = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--generate", "--generate-formats", "fp8"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--generate-formats fp8" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--generate", "--prefill-tokens", "0"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--prefill-tokens [0]: each must be >= 1" in bad.stderr
    both = subprocess.run([sys.executable, "-m", "ds_fpquant", "bench", "--generate", "--linear"],
                          capture_output=True, text=True, timeout=600)
    assert both.returncode == 2 and "give one" in both.stderr


def test_generate_rebuilds_the_same_model():
    """Every row is built anew from the seed: the builds must hold the same weights (the bench compares them)."""
    from ds_fpquant.cli.bench import generate

    spec = dict(generate.LLAMA_TINY, num_hidden_layers=1)
    a, b = generate.build_model(spec), generate.build_model(spec)
    assert generate.fingerprint(a) == generate.fingerprint(b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert next(a.parameters()).dtype == torch.bfloat16
    assert generate.target_linears(a) == [n for n, m in a.named_modules()
                                          if isinstance(m, torch.nn.Linear) and n != "lm_head"]


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


def test_roofline_arithmetic_on_a_fake_measurement():
    """roofline_ms = max(bytes / bandwidth, 2 * MACs / peak), in ms, with the larger term named; the row's share is
    roofline / measured; bad limits are refused."""
    from ds_fpquant.cli.bench import linear as bench_linear
    from ds_fpquant.cli.bench import roofline

    # 4096x4096 e4m3 g128 at M=1: 16 MiB + 0.5 MiB of scales over 30 GB/s = 0.5767 ms; 2 * 16.8 M flops at
    # 100 GFLOP/s = 0.3355 ms: memory-bound
    nbytes, macs = 4096 * 4096 + 4096 * 32 * 4, 4096 * 4096
    ms, bound = roofline.roofline_ms(nbytes, macs, 30.0, 100.0)
    assert bound == "memory" and ms == pytest.approx(nbytes / 30e9 * 1e3, rel=1e-12)
    # M=256: 2 * 256 * 16.8 M flops at 100 GFLOP/s = 85.9 ms: compute-bound
    ms, bound = roofline.roofline_ms(nbytes, 256 * macs, 30.0, 100.0)
    assert bound == "compute" and ms == pytest.approx(2 * 256 * macs / 100e9 * 1e3, rel=1e-12)
    assert roofline.roofline_ms(nbytes, 256 * macs, 30.0, None) == (pytest.approx(nbytes / 30e6), "memory")
    for bad in ((nbytes, macs, 0.0, 1.0), (nbytes, macs, 30.0, 0.0), (-1, macs, 30.0, 1.0), (nbytes, -1, 30.0, None)):
        with pytest.raises(ValueError, match="must be"):
            roofline.roofline_ms(*bad)
    facts = roofline.KernelFacts(frozenset({"avx2", "fma"}), (), "AVX2", False)
    peaks = {"fp32_fma_ymm": roofline.Peak("fp32_fma_ymm", "vfmadd231ps ymm", 100.0)}
    row = bench_linear.LinearResult(4096, 4096, 256, "fused", "e4m3", 2, None, 120.0, weight_bytes=nbytes,
                                    macs=256 * macs)
    bench_linear.add_roofline(row, 30.0, facts, peaks)
    assert row.peak.startswith("fp32_fma_ymm (") and row.peak_gflops == 100.0 and row.bound == "compute"
    assert row.roofline_ms == pytest.approx(85.899, rel=1e-4) and row.of_roofline == pytest.approx(85.899 / 120, 1e-4)
    table = bench_linear.format_table([row])
    assert "| 4096x4096 | 256 | fused | e4m3 | bf16 | - | - | 120.000 (2 layers) |" in table
    assert "| 85.899 | compute | 72% | fp32_fma_ymm (100) |" in table


def test_each_row_uses_the_peak_of_the_instruction_it_runs():
    """roofline.row_peak on the machines the project meets: AVX2 only (everything fp32 FMA ymm); AVX-512 BF16 with
    the op's bf16_dot path (bf16 x fused rows and torch's oneDNN bf16 on vdpbf16ps, fp32 on zmm, the peers at torch's
    AVX512 width); AMX (torch's bf16 on tdpbf16ps); a wanted peak that was not measured falls back to the best fp32
    FMA and says why; no peaks at all gives None."""
    from ds_fpquant.cli.bench.roofline import KernelFacts, Peak, row_peak

    def peaks(**gflops):
        return {k: Peak(k, k, v, "" if v else "this CPU lacks it") for k, v in gflops.items()}

    avx2 = KernelFacts(frozenset({"avx2", "fma"}), (), "AVX2", False)
    p = peaks(fp32_fma_ymm=90.0)
    for impl, x in (("nn.Linear fp32", "fp32"), ("nn.Linear bf16", "bf16"), ("torch int8pack", "bf16"),
                    ("torch int4pack", "bf16"), ("fused", "bf16"), ("fused", "fp32"), ("dequantize + matmul", "bf16")):
        text, rate = row_peak(impl, x, avx2, p)
        assert text.startswith("fp32_fma_ymm (") and rate == 90.0, (impl, x, text)
    assert "ATen's bf16 gemm widened to fp32" in row_peak("nn.Linear bf16", "bf16", avx2, p)[0]
    zen4 = KernelFacts(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
                       ("fast_decode", "bf16_dot", "direct_bf16"), "AVX512", True)
    p = peaks(fp32_fma_ymm=90.0, fp32_fma_zmm=180.0, bf16_dot_zmm=360.0)
    assert row_peak("fused", "bf16", zen4, p)[1] == 360.0 and row_peak("fused", "fp32", zen4, p)[1] == 180.0
    assert row_peak("nn.Linear bf16", "bf16", zen4, p)[1] == 360.0
    assert row_peak("nn.Linear fp32", "fp32", zen4, p)[1] == 180.0
    assert row_peak("torch int8pack", "bf16", zen4, p)[1] == 180.0
    portable_build = KernelFacts(zen4.flags, (), "AVX512", True)  # DS_FPQUANT_CPU_ARCH=x86-64-v3 on that CPU
    text, rate = row_peak("torch int4pack", "bf16", portable_build, peaks(fp32_fma_ymm=90.0))
    assert rate == 90.0 and text.startswith("fp32_fma_ymm (") and "fp32_fma_zmm not measured: not in this build" in text
    spr = KernelFacts(frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), ("fast_decode", "bf16_dot"),
                      "AVX512", True)
    p = peaks(fp32_fma_ymm=90.0, fp32_fma_zmm=180.0, bf16_dot_zmm=360.0, amx_bf16=None)
    text, rate = row_peak("nn.Linear bf16", "bf16", spr, p)
    assert rate == 180.0 and "amx_bf16 not measured: this CPU lacks it" in text
    assert row_peak("nn.Linear bf16", "bf16", spr, peaks(amx_bf16=2000.0))[1] == 2000.0
    assert row_peak("fused", "bf16", KernelFacts(spr.flags, ("amx_gemm",), "AVX512", True), peaks(amx_bf16=2000.0))[1] \
        == 2000.0
    assert row_peak("fused", "bf16", avx2, {}) == ("none (fp32_fma_ymm not measured: not in this build)", None)


def test_time_case_repeats_by_the_cost_of_a_case(monkeypatch):
    """A fast case: a warm-up call, `repeat` resident calls, a warm-up pass and `repeat` passes; a slow one: the
    warm-up call and one pass, no resident time; the warm-up output goes to the check before anything is timed.
    (The thresholds are set so that the outcome does not depend on this machine's speed.)"""
    from ds_fpquant.cli.bench import linear as bench_linear

    calls, checked = [], []
    call = lambda w: calls.append(w) or w  # noqa: E731
    monkeypatch.setattr(bench_linear, "SLOW_CALL_MS", 1e9)
    monkeypatch.setattr(bench_linear, "RESIDENT_SECONDS", 1e9)
    monkeypatch.setattr(bench_linear, "CASE_SECONDS", 1e9)
    resident, model, n_resident, passes = bench_linear.time_case(call, [1, 2, 3], 4, check=checked.append)
    assert checked == [1] and (n_resident, passes) == (4, 4) and resident >= 0 and model >= 0
    assert calls == [1] + [1] * 4 + [1, 2, 3] * 5
    calls.clear()
    monkeypatch.setattr(bench_linear, "SLOW_CALL_MS", -1.0)
    monkeypatch.setattr(bench_linear, "CASE_SECONDS", 0.0)
    resident, model, n_resident, passes = bench_linear.time_case(call, [1, 2, 3], 4)
    assert resident is None and (n_resident, passes) == (0, 1) and calls == [1, 1, 2, 3]
    with pytest.raises(RuntimeError, match="wrong"):
        bench_linear.time_case(call, [1], 2, check=lambda y: (_ for _ in ()).throw(RuntimeError("wrong")))


def test_layer_counts_make_each_pass_several_caches():
    from ds_fpquant.cli.bench.linear import layer_count

    mib = 2**20
    assert layer_count(int(8.25 * mib), 8 * mib, 4.0) == 4  # 4096x4096 e2m1 g128 over an 8 MiB L3
    assert layer_count(32 * mib, 8 * mib, 4.0) == 1  # 4096x4096 bf16: one layer is 4 caches
    assert layer_count(112 * mib, 32 * mib, 4.0) == 2  # 14336x4096 bf16 over 32 MiB
    assert layer_count(int(0.77 * mib), 8 * mib, 4.0) == 42  # a 768x2048 e2m1 expert
    assert layer_count(0, 8 * mib, 4.0) >= 1


def test_peer_check_on_the_first_rows_of_the_weight():
    """keep_rows: the fp64 weight of the first rows only; check_peer then compares those outputs of every row of x,
    and a layout mistake is still caught."""
    from ds_fpquant.cli.bench import peers

    torch.manual_seed(2)
    w = torch.randn(64, 256) * 0.02
    x = torch.randn(7, 256).bfloat16()
    for make in (peers.int8pack_weight, peers.int4pack_weight):
        p = make(w, keep_dequantized=True, keep_rows=16)
        full = make(w, keep_dequantized=True)
        assert p.dequantized.shape == (16, 256) and torch.equal(p.dequantized, full.dequantized[:16])
        y = peers.peer_linear(x, p)
        assert peers.check_peer(x, p, y) <= 1 and peers.check_peer(x, p) <= 1
        bad = y.clone()
        bad[3, 5] += 10 * float(y.abs().max())
        assert peers.check_peer(x, p, bad) > 4


def test_limits_of_a_run_are_the_better_of_start_and_end(tmp_path):
    """merge_limits keeps the higher bandwidth and per kind the higher peak; apply_limits puts them into every row;
    the hypervisor's steal time is read from /proc/stat's cpu line (its 8th value, in clock ticks)."""
    from ds_fpquant.cli.bench import linear as bench_linear
    from ds_fpquant.cli.bench.roofline import KernelFacts, Peak

    facts = KernelFacts(frozenset(), (), "AVX2", False)

    def limits(gbps, **peaks):
        read = bench_linear.LinearResult(0, 0, 0, bench_linear.READ_IMPL, "-", 1, None, 1.0, weight_bytes=2**20,
                                         model_gbps=gbps)
        return read, {k: Peak(k, k, v) for k, v in peaks.items()}, facts

    merged = bench_linear.merge_limits(limits(15.0, fp32_fma_ymm=80.0, amx_bf16=None), limits(17.0, fp32_fma_ymm=56.0))
    assert merged[0].model_gbps == 17.0 and merged[1]["fp32_fma_ymm"].gflops == 80.0
    assert merged[1]["amx_bf16"].gflops is None
    row = bench_linear.LinearResult(4096, 4096, 1024, "fused", "e4m3", 2, None, 500.0, weight_bytes=17 * 2**20,
                                    macs=1024 * 4096 * 4096, model_gbps=0.035)
    results = [limits(15.0)[0], row]
    bench_linear.apply_limits(results, merged)
    assert results[0] is merged[0] and row.of_read_bw == pytest.approx(0.035 / 17.0)
    assert row.roofline_ms == pytest.approx(2 * 1024 * 4096 * 4096 / 80e6) and row.bound == "compute"
    stat = tmp_path / "stat"
    stat.write_text("cpu  1113522 0 42789 411343 4201 0 1558 3762 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    import os

    assert bench_linear.cpu_steal_seconds(str(stat)) == pytest.approx(3762 / os.sysconf("SC_CLK_TCK"))
    assert bench_linear.cpu_steal_seconds(str(tmp_path / "missing")) is None


def test_layer_counts_are_cut_to_fit_the_memory_budget(tmp_path):
    """A VM reporting a host's 480 MiB L3 on a 24 GiB guest: 4 LLCs per kind of 9 kinds do not fit; every count is cut
    by the same factor (at least one layer), and counts that fit are kept."""
    from ds_fpquant.cli.bench.linear import available_memory_bytes, fit_layer_counts

    mib = 2**20
    counts = {"fp32": 30, "bf16": 60, "e2m1": 226}
    nbytes = {"fp32": 64 * mib, "bf16": 32 * mib, "e2m1": int(8.5 * mib)}
    total = sum(counts[k] * nbytes[k] for k in counts)
    assert fit_layer_counts(counts, nbytes, None) == counts
    assert fit_layer_counts(counts, nbytes, total) == counts
    fitted = fit_layer_counts(counts, nbytes, total // 4)
    assert sum(fitted[k] * nbytes[k] for k in counts) <= total // 4
    assert fitted == {"fp32": 7, "bf16": 15, "e2m1": 56}
    assert fit_layer_counts(counts, nbytes, 1) == {"fp32": 1, "bf16": 1, "e2m1": 1}
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory_bytes(str(meminfo)) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_memory_bytes(str(meminfo)) is None
    assert available_memory_bytes(str(tmp_path / "missing")) is None
