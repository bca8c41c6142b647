"""The compiled op's peak dot-product loops (csrc/fp_quantizer/fp_peak_cpu.cpp), the compute side of the bench's
roofline: which loops a build has, that each one this machine runs reports a rate a CPU can physically reach, that
bad arguments are refused, and (compiled here for other targets) that each loop is the instruction it names."""

import os
import platform
import shutil
import subprocess

import pytest
import torch

from ds_fpquant.cli.bench import roofline

#: Per core and cycle, the most floating-point operations (a multiply-add counted as 2) any x86 core executes of
#: each loop's instruction: two FMA pipes (Intel since Haswell, AMD since Zen 2) of 8 (ymm) or 16 (zmm) fp32 lanes;
#: vdpbf16ps zmm is 32 bf16 multiply-adds, at most two a cycle; one tdpbf16ps (16 x 16 x 32 multiply-adds) issues
#: every 16 cycles on Sapphire Rapids: 1024 flops a cycle.
FLOPS_PER_CYCLE = {"fp32_fma_ymm": 2 * 8 * 2, "fp32_fma_zmm": 2 * 16 * 2, "bf16_dot_zmm": 2 * 32 * 2,
                   "amx_bf16": 16 * 16 * 32 * 2 // 16}

#: Above any x86 core's clock (the fastest boost clock shipped, Intel's i9-14900KS, is 6.2 GHz).
MAX_GHZ = 6.5

#: What one instruction of each loop computes (a multiply-add counted as 2): fp32 lanes x 2, bf16 pairs x 2 x 2,
#: and a 16 x 16 tile of 32-term bf16 dot products.
FLOPS_PER_INSTRUCTION = {"fp32_fma_ymm": 8 * 2, "fp32_fma_zmm": 16 * 2, "bf16_dot_zmm": 16 * 2 * 2,
                         "amx_bf16": 16 * 16 * 32 * 2}

X86 = platform.machine() in ("x86_64", "AMD64")


def _op():
    from ds_fpquant.ops.backends import load_op

    module, why = load_op("cpu")
    if module is None:
        pytest.skip(f"no compiled CPU op: {why}")
    return module


def _build_macros():
    from ds_fpquant.op_builder import builder
    from ds_fpquant.op_builder.fp_quantizer_cpu import FPQuantizerCPUBuilder

    cpu = FPQuantizerCPUBuilder()
    return set(builder.resolved_target(os.environ.get("CXX", "c++"), builder.target_flags(cpu.cxx_args())).splitlines())


def test_peak_loops_are_those_of_the_build_target_and_run_where_the_cpu_has_them():
    """fp32_fma_ymm on every x86-64 build; the AVX-512 and AMX loops exactly where the build's target has their
    instruction sets; each available exactly where /proc/cpuinfo lists its instructions (AMX: unless Linux refused
    the tile-data permission, which the reason then names)."""
    op = _op()
    kinds = {k["name"]: k for k in op.dot_peak_kinds()}
    if not X86:
        assert kinds == {}
        return
    macros = _build_macros()
    has = {isa: f"#define __{isa}__ 1" in macros for isa in ("AVX512F", "AVX512BF16", "AMX_TILE", "AMX_BF16")}
    expected = ["fp32_fma_ymm"] + [name for name, ok in (
        ("fp32_fma_zmm", has["AVX512F"]), ("bf16_dot_zmm", has["AVX512F"] and has["AVX512BF16"]),
        ("amx_bf16", has["AMX_TILE"] and has["AMX_BF16"])) if ok]
    assert list(kinds) == expected
    flags = roofline.cpu_flags()
    needs = {"fp32_fma_ymm": {"avx2", "fma"}, "fp32_fma_zmm": {"avx512f"}, "bf16_dot_zmm": {"avx512f", "avx512_bf16"},
             "amx_bf16": {"amx_tile", "amx_bf16"}}
    for name, kind in kinds.items():
        assert kind["instruction"] == roofline.PEAK_KINDS[name]
        assert kind["flops_per_instruction"] == FLOPS_PER_INSTRUCTION[name]
        if not needs[name] <= flags:
            assert "this CPU lacks" in kind["unavailable"], (name, kind)
        elif name == "amx_bf16" and kind["unavailable"]:
            assert "arch_prctl" in kind["unavailable"] or "kernel" in kind["unavailable"], kind
        else:
            assert kind["unavailable"] == "", (name, kind)
    assert kinds["fp32_fma_ymm"]["accumulators"] >= 10  # 2 FMA pipes x 5 cycles of latency (Zen 2)


def test_peak_rates_are_positive_and_below_the_physical_ceiling():
    """Each loop this machine runs, on 1 thread and on torch's thread count: a rate above 0 and below
    threads x FLOPS_PER_CYCLE x MAX_GHZ (a loop that counted more instructions than it ran, or ran fewer than it
    counted, e.g. a dead chain the compiler dropped, lands above it). No timing is asserted beyond that ceiling."""
    op = _op()
    ran = 0
    for kind in op.dot_peak_kinds():
        if kind["unavailable"]:
            continue
        for threads in dict.fromkeys((1, torch.get_num_threads())):
            rate = op.dot_peak_gflops(kind["name"], threads, 0.02, 1)
            ceiling = threads * FLOPS_PER_CYCLE[kind["name"]] * MAX_GHZ
            assert 0 < rate < ceiling, (kind, threads, rate, ceiling)
            ran += 1
    if X86 and {"avx2", "fma"} <= roofline.cpu_flags():
        assert ran >= 1


def test_peak_arguments_are_checked():
    op = _op()
    with pytest.raises(ValueError, match=r"kind='fp64_fma' is not a peak loop of this build; allowed: "):
        op.dot_peak_gflops("fp64_fma", 1)
    if not X86:
        return
    with pytest.raises(ValueError, match="threads=0: must be in 1 .. 4096"):
        op.dot_peak_gflops("fp32_fma_ymm", 0)
    with pytest.raises(ValueError, match="trials=0"):
        op.dot_peak_gflops("fp32_fma_ymm", 1, 0.01, 0)
    for seconds in (0.0, -1.0, 11.0, float("nan")):
        with pytest.raises(ValueError, match="min_seconds=.*must be in"):
            op.dot_peak_gflops("fp32_fma_ymm", 1, seconds, 1)
    for kind in op.dot_peak_kinds():
        if kind["unavailable"]:
            with pytest.raises(ValueError, match="cannot run here: "):
                op.dot_peak_gflops(kind["name"], 1, 0.01, 1)


#: Register-only loops of each kind, as counted in the object code: the accumulators of fp_peak_cpu.cpp. Sapphire
#: Rapids has all four instruction sets; x86-64-v2 none of them (the AVX2 loop comes from its target attribute).
LOOP_INSTRUCTIONS = {"sapphirerapids": {"ymm": 12, "zmm": 24, "vdpbf16ps": 24, "tdpbf16ps": 6},
                     "x86-64-v2": {"ymm": 12, "zmm": 0, "vdpbf16ps": 0, "tdpbf16ps": 0}}


@pytest.mark.skipif(not X86, reason="the loops are x86-64 code")
@pytest.mark.parametrize("target", list(LOOP_INSTRUCTIONS))
def test_peak_loops_compile_to_their_instructions(tmp_path, target):
    """The loops the development machine cannot run (AVX-512, AVX-512 BF16, AMX) compiled for CPUs that have them:
    each loop is its instruction on as many accumulators as it counts, with no load or store in the loop (the
    instructions between the loop's label and its branch back); x86-64-v2 (no FMA in the target) still has the
    AVX2 loop, through its target attribute."""
    cxx = os.environ.get("CXX", "c++")
    objdump = shutil.which("objdump")
    if objdump is None or shutil.which(cxx.split()[0]) is None:
        pytest.skip("needs a C++ compiler and objdump")
    from ds_fpquant.op_builder.builder import csrc_path, cxx_std_flag

    obj = tmp_path / "peak.o"
    cmd = [*cxx.split(), "-O3", cxx_std_flag(), f"-march={target}", "-fopenmp", "-ffp-contract=off", "-Wall",
           "-Werror", "-I", csrc_path("fp_quantizer", "includes"), "-c", csrc_path("fp_quantizer", "fp_peak_cpu.cpp"),
           "-o", str(obj)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "march" in build.stderr and "bad value" in build.stderr:
        pytest.skip(f"{cxx} does not know -march={target}")
    assert build.returncode == 0, build.stderr[-3000:]
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                          timeout=120).stdout
    counts = {"ymm": 0, "zmm": 0, "vdpbf16ps": 0, "tdpbf16ps": 0}
    for loop in _loops(text):
        body = [line.split("\t", 1)[-1].strip() for line in loop]
        assert not any("(%r" in b and not b.startswith(("j", "nop")) for b in body), loop  # registers only
        counts["ymm"] += sum(b.startswith("vfmadd") and "%ymm" in b for b in body)
        counts["zmm"] += sum(b.startswith("vfmadd") and "%zmm" in b for b in body)
        counts["vdpbf16ps"] += sum(b.startswith("vdpbf16ps") for b in body)
        counts["tdpbf16ps"] += sum(b.startswith("tdpbf16ps") for b in body)
    assert counts == LOOP_INSTRUCTIONS[target], counts


def _loops(disassembly: str):
    """The innermost loops of each function in objdump output: the lines from a backward branch's target to the
    branch, for every backward branch whose body has a multiply-add."""
    for function in disassembly.split("\n\n"):
        lines = [line for line in function.splitlines() if ":\t" in line]
        addresses = [int(line.split(":")[0], 16) for line in lines]
        for i, line in enumerate(lines):
            parts = line.split("\t")
            if len(parts) < 2 or not parts[-1].startswith("j"):
                continue
            target = parts[-1].split()[1] if len(parts[-1].split()) > 1 else ""
            try:
                to = int(target, 16)
            except ValueError:
                continue
            if to < addresses[i] and to in addresses:
                body = lines[addresses.index(to):i + 1]
                if any(("fmadd" in b or "dpbf16ps" in b) for b in body):
                    yield body
