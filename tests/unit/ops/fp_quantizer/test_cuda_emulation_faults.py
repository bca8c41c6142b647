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
    "GEMV mma A fragment lane mapping: a1 takes row r's k 8..15 instead of row r + 8's k 0..7": (
        GEMV, "const uint32_t a[4] = {ha[2 * s], hb[2 * s], ha[2 * s + 1], hb[2 * s + 1]};",
        "const uint32_t a[4] = {ha[2 * s], ha[2 * s + 1], hb[2 * s], hb[2 * s + 1]};"),
    "GEMV mma B fragment registers swapped (x's k 8..15 against the codes' k 0..7)": (
        GEMV, "mma_16816<kBf16>(st.chain[t], a, xb[t][2 * s], xb[t][2 * s + 1], st.chain[t]);",
        "mma_16816<kBf16>(st.chain[t], a, xb[t][2 * s + 1], xb[t][2 * s], st.chain[t]);"),
    "GEMV k permutation applied to the codes but not to x (x chunks left in k order)": (
        GEMV, "*p = make_uint4(out[0], out[1], out[2], out[3]);", "(void)out;  // x left in k order"),
    "GEMV consumes a stage without cp.async.wait_group (its copies not landed)": (
        GEMV, "cp_async_wait<kGemvStages - 2>();  // this lane's copies of stage j + 1", ""),
    "GEMV refills the stage about to be consumed (a stage reused before it is consumed)": (
        GEMV, "if (refill < n_stages) { producer.issue(buffer_free, p, stage0 + refill); }",
        "if (refill < n_stages) { producer.issue(buffer_next, p, stage0 + refill); }"),
    "GEMV multiplies a group's chain by the next group's scale (groups of whole windows)": (
        GEMV, "            flush(st, *srow_r, *srow_r8);", "            flush(st, srow_r[1], srow_r8[1]);"),
    "GEMV multiplies a group's chain by the next group's scale (piece layouts)": (
        GEMV, "add_scaled(st, s_r[s / kPeriod], s_r8[s / kPeriod]);",
        "add_scaled(st, s_r[(s / kPeriod + 1) % kGroups], s_r8[(s / kPeriod + 1) % kGroups]);"),
    "GEMV decodes subnormal codes as zero (an HMUL2 that flushes subnormal inputs)": (
        GEMV, "        memcpy(&x, &a, 4);",
        "        uint32_t f = a;\n        if (!(f & 0x7f800000u)) { f &= 0x8000ffffu; }\n"
        "        if (!(f & 0x7f80u)) { f &= 0xffff8000u; }\n        memcpy(&x, &f, 4);"),
    "GEMV split-K's last block adds one split short": (
        GEMV, "for (int s = 1; s < p.splits; ++s)", "for (int s = 1; s < p.splits - 1; ++s)"),
    "GEMV split-K's last block leaves its counter set (issue 42: the next launch would count from it)": (
        GEMV, "if (tid == 0) { a.counters[blockIdx.x] = 0; }", "(void)0;"),
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
    # the GEMV (tensor cores): the padded path (ragged groups); the cp.async ring over three stages per block (one SM:
    # no split) with groups of whole windows (e3m2: chains across windows, the x permutation) and piece layouts (e2m1,
    # e4m7 at G=32); split-K (11 rows: one tile, a split per stage on 132 SMs); subnormal codes (weights down to 2^-11
    # of their group's amax) of the Placed and e2m1 decoders; bf16 and fp16 x
    gen = torch.Generator().manual_seed(7)
    for fmt, rows, k, group_size, dtype, sms in [
            ("e4m3", 3, 129, 48, torch.bfloat16, 132), ("e2m1", 2, 3072, 32, torch.bfloat16, 1),
            ("e5m2", 9, 1536, 128, torch.float16, 132), ("e3m2", 5, 1920, 128, torch.bfloat16, 1),
            ("e4m7", 4, 960, 32, torch.bfloat16, 1), ("e2m3", 1, 1280, 64, torch.bfloat16, 132)]:
        w = torch.randn(11, k, generator=gen) * 2.0 ** -torch.randint(0, 12, (11, k), generator=gen).float()
        qt = fpq.quantize(w, fmt, group_size)
        x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(11, generator=gen).to(dtype)
        op.num_sms = sms
        assert_linear_within_bound(x, qt, bias, run_gemv(op, x, qt, bias), tensor_cores=True)
    op.num_sms = 132
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
