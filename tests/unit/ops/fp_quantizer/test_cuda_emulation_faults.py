"""Fault injection: deliberately broken copies of the CUDA kernels must fail the emulation tests.

Each mutant is the repository's kernel headers with one edit in one file (the edited text must still be
there, so a refactoring cannot turn a mutant into the original silently), built for sm_90 and run
through a battery of the same reference comparisons as test_cuda_emulation.py. The battery must
fail, by a wrong bit, an unwritten byte, an ASan/UBSan report or a warp-synchronisation error.
"""

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound
from unit.ops.fp_quantizer.emulation import cuda_emulation
from unit.ops.fp_quantizer.emulation.cuda_emulation import EmulatedCudaOp, run_gemv
from unit.ops.fp_quantizer.emulation.cuda_emulation import check_against_reference as check
from unit.oracle import special_input

import ds_fpquant as fpq

KERNELS = "fp_quantize_kernels.cuh"
GEMV = "fp_gemv_kernels.cuh"
CODEC = "fp_codec.h"

#: name -> (header, its text, the broken replacement); the first occurrence is replaced.
MUTANTS = {
    "quantize tail off by one (reads and encodes one element past a ragged group)": (
        KERNELS, "const int64_t len = active ? min(g.group_size, g.k - start) : 0;",
        "const int64_t len = active ? min(g.group_size, g.k - start + 1) : 0;"),
    "dequantize tail off by one (writes one element past a ragged group)": (
        KERNELS, "const int64_t len = min(g.group_size, g.k - start);",
        "const int64_t len = min(g.group_size, g.k - start + 1);"),
    "last chunk's code bytes off by one": (
        KERNELS, "return left < kBytes ? int(left) : kBytes;",
        "return left < kBytes ? int(left) + 1 : kBytes;"),
    "wrong team mask (lane index masked with the team size, not size - 1)": (
        KERNELS, "return {int(threadIdx.x & ((1 << team_log2) - 1)),",
        "return {int(threadIdx.x & (1 << team_log2)),"),
    "shuffle mask names half the warp": (
        KERNELS, "constexpr unsigned kFullMask = 0xffffffffu;",
        "constexpr unsigned kFullMask = 0x0000ffffu;"),
    "team amax reduction one step short": (
        KERNELS, "for (int offset = (1 << team_log2) >> 1; offset > 0; offset >>= 1) {",
        "for (int offset = (1 << team_log2) >> 1; offset > 1; offset >>= 1) {"),
    "missing active guard (lanes past the last group write its scale)": (
        KERNELS, "        if (!active) { continue; }\n", ""),
    "16-byte loads chosen without the base pointer's alignment": (
        KERNELS, "return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (k * elem_bytes) % 16 == 0 &&",
        "return (k * elem_bytes) % 16 == 0 &&"),
    "warp-divergent group loop (no warp offset: teams of a warp leave the loop at different trips)": (
        KERNELS, "const int64_t warp_offset = (threadIdx.x & 31) >> team_log2;", "const int64_t warp_offset = 0;"),
    "hardware fp8 pair unpacked in the wrong byte order": (
        KERNELS, "codes[j] = pair & 0xffu;\n            codes[j + 1] = pair >> 8;",
        "codes[j] = pair >> 8;\n            codes[j + 1] = pair & 0xffu;"),
    "stochastic rounding reads the wrong Philox word": (
        KERNELS, "const int skip = int(first & 3);", "const int skip = int(first & 1);"),
    "GEMV x tile staged one element past a ragged group (reads x past the row)": (
        GEMV, "valid = c * kCodes + pos < min(group_size, k - g * group_size);",
        "valid = c * kCodes + pos <= min(group_size, k - g * group_size);"),
    "GEMV warp sum one shuffle step short": (
        GEMV, "for (int offset = 16; offset > 0; offset >>= 1) {", "for (int offset = 16; offset > 1; offset >>= 1) {"),
    "GEMV multiplies a chunk's partial sums by the next group's scale": (
        GEMV, "a.w.scale_cols + f / chunks_per_group);", "a.w.scale_cols + (f / chunks_per_group + 1) % n_groups);"),
    "GEMV reads the x tile without waiting for the block to stage it (no __syncthreads)": (
        GEMV, "        __syncthreads();\n\n        // 2. the warp's row", "\n        // 2. the warp's row"),
    "GEMV e2m1 selector picks the wrong bytes (codes 7, 3 instead of 3, 7)": (
        GEMV, "pair(__byte_perm(odd, 0u, 0x4431), w[i]);", "pair(__byte_perm(odd, 0u, 0x4413), w[i]);"),
    "GEMV e5m2 pair permute swaps the two codes": (
        GEMV, "h[2 * i] = __byte_perm(w[i], 0u, 0x1404);", "h[2 * i] = __byte_perm(w[i], 0u, 0x0414);"),
    "E8M0 ceil exponent not capped at 127 - emax_elem (SPEC 3.2)": (
        CODEC, "e = e > kCap ? kCap : e;", "(void)kCap;"),
}


def mutant_headers(name: str) -> dict:
    header, original, broken = MUTANTS[name]
    text = (cuda_emulation.KERNEL_INCLUDES / header).read_text()
    assert original in text, f"mutant {name!r}: {original!r} is no longer in {header}"
    return {header: text.replace(original, broken, 1)}


@pytest.fixture(scope="module")
def built_mutants():
    if not cuda_emulation.compiler_available():
        pytest.skip(f"no C++ compiler ({cuda_emulation.CXX}) to build the CUDA emulation")
    cuda_emulation.build_all([(900, mutant_headers(name)) for name in MUTANTS])


def battery(op: EmulatedCudaOp) -> None:
    """The emulation tests' paths in a few calls: teams of 1..32 lanes on ragged rows, 4/6/8-bit codes,
    misaligned buffers, a wrapped grid, stochastic rounding with an offset that starts mid-block, an E8M0
    scale at the top of fp32, the GEMV."""
    for group_size in [1, 8, 100, 1537]:
        check(op, special_input((3, 2 * group_size + 5), torch.bfloat16, seed=group_size), "e4m3", group_size)
    check(op, special_input((3, 205), torch.float32, seed=2), "e2m1", 100)
    check(op, special_input((7, 13), torch.float16, seed=3), "e3m2", 8)
    check(op, special_input((4, 37), torch.float32, seed=4), "e4m3", 37, rounding="stochastic", seed=9, offset=3)
    check(op, torch.tensor([[3.4028235e38] + [1.0] * 31]), "mxfp4")  # E8M0 scale at the top of fp32
    # the GEMV: ragged groups and a partial block of rows; whole groups (the kFull loop) of 4- and 8-bit codes
    for fmt, rows, k, group_size in [("e4m3", 3, 129, 48), ("e2m1", 2, 256, 32), ("e5m2", 1, 128, 64)]:
        qt = fpq.quantize(torch.randn(11, k), fmt, group_size)
        x, bias = torch.randn(rows, k).to(torch.bfloat16), torch.randn(11).to(torch.bfloat16)
        assert_linear_within_bound(x, qt, bias, run_gemv(op, x, qt, bias))
    op.misalign = {"x": 2, "out": 2, "codes": 1}
    check(op, special_input((3, 136), torch.bfloat16, seed=5), "e4m3", 64, out_dtypes=[torch.bfloat16])
    op.misalign, op.max_blocks = {}, 1
    check(op, special_input((70, 103), torch.bfloat16, seed=6), "e2m1", 100)


def test_battery_passes_on_the_real_kernels(sm90):
    battery(sm90)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_broken_kernel_is_caught(built_mutants, name):
    op = EmulatedCudaOp(900, mutant_headers(name))
    try:
        with pytest.raises(AssertionError) as caught:
            battery(op)
    finally:
        op.close()
    print(f"{name}: caught by {str(caught.value).splitlines()[0][:200]}")
