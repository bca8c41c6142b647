"""scripts/sass_budget.py on a canned SASS listing (no nvcc): the steady-state loop is found from the backward
branches, weights per iteration from its FFMA and the rows of x, resources from res-usage and ptxas -v."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "sass_budget.py"
MANGLED = "_ZN3fpq12cuda_kernels11gemv_kernelINS_12FormatTraitsILi4ELi3ELNS_7TopCodeE0EEENS_4Bf16ELb1EEEvNS_8GemvArgsE"

# A kernel with an outer loop (0x0040 .. 0x0100) around an inner one (0x0060 .. 0x00c0) that holds every FFMA, a
# second back edge to the inner loop's head (a `continue`), and the self-branch nvcc puts after EXIT.
SASS = f"""
	code for sm_90
		Function : {MANGLED}
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                           /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                               /* 0x0000000000007919 */
        /*0020*/                   MOV R2, RZ ;                                     /* 0x000000ff00027202 */
        /*0030*/                   MOV R3, RZ ;                                     /* 0x000000ff00037202 */
        /*0040*/                   LDS.128 R4, [R0] ;                               /* 0x0000000000047984 */
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                    /* 0x0000000000007b1d */
        /*0060*/                   LDG.E.128 R8, desc[UR4][R2.64] ;                 /* 0x0000000402087981 */
        /*0070*/                   FFMA R12, R4, R8, R12 ;                          /* 0x0000000804 0c7223 */
        /*0080*/              @P0  BRA 0x60 ;                                       /* 0x0000000000000947 */
        /*0090*/                   FFMA R12, R5, R9, R12 ;                          /* 0x00000009050c7223 */
        /*00a0*/                   IADD3 R2, R2, 0x10, RZ ;                         /* 0x0000001002027810 */
        /*00b0*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;                /* 0x000000030200720c */
        /*00c0*/              @!P0 BRA 0x60 ;                                       /* 0x0000000000008947 */
        /*00d0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                    /* 0x0000000000007b1d */
        /*00e0*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;                /* 0x000000030200720c */
        /*00f0*/                   IADD3 R3, R3, 0x1, RZ ;                          /* 0x0000000103037810 */
        /*0100*/              @!P1 BRA 0x40 ;                                       /* 0x0000000000009947 */
        /*0110*/                   EXIT ;                                           /* 0x000000000000794d */
        /*0120*/                   BRA 0x120;                                       /* 0xfffffffc00fc7947 */
		..........
"""
RES_USAGE = f""" Function {MANGLED}:
  REG:40 STACK:0 SHARED:4096 LOCAL:0 CONSTANT[0]:664 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
PTXAS = f"""ptxas info    : Compiling entry function '{MANGLED}' for 'sm_90'
ptxas info    : Function properties for {MANGLED}
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers
"""


@pytest.fixture(scope="module")
def sass_budget():
    spec = importlib.util.spec_from_file_location("sass_budget", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sass_budget"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_loops_from_backward_branches(sass_budget):
    ins = sass_budget.split_functions(SASS)[MANGLED]
    assert len(ins) == 19
    found = sorted((loop.start, loop.end, loop.instructions, loop.ffma) for loop in sass_budget.loops(ins))
    assert found == [(0x40, 0x100, 13, 2), (0x60, 0xc0, 7, 2), (0x120, 0x120, 1, 0)]
    inner = sass_budget.steady_state_loop(ins)
    assert (inner.start, inner.end) == (0x60, 0xc0)  # the smallest loop with the most FFMA


def test_budget_row(sass_budget):
    (row,) = sass_budget.budgets(SASS, RES_USAGE, PTXAS)
    assert (row.fmt, row.dtype, row.rows, row.variant) == ("e4m3", "bf16", 16, "true")  # no kRows: 16 rows unrolled
    assert row.loop_instructions == 7 and row.weights_per_iteration == 2 / 16
    assert row.instructions_per_weight == 56.0
    assert (row.registers, row.shared, row.spill_bytes) == (40, 4096, 12)
    assert "| e4m3 | bf16 | 16 | true | 7 |" in sass_budget.table([row])


def test_scale_ffma_is_not_a_weight(sass_budget):
    """A chunk of 16 weights, one row of x: 16 product FFMA and the scale's FFMA -> 16 weights per iteration."""
    body = "".join(f"        /*{0x60 + 16 * i:04x}*/                   FFMA R12, R4, R8, R12 ;\n" for i in range(17))
    sass = SASS.split("        /*0060*/")[0] + body + f"        /*{0x60 + 16 * 17:04x}*/              @!P0 BRA 0x60 ;\n"
    sass = sass.replace("NS_4Bf16ELb1E", "NS_4Bf16ELi1ELb1E")  # gemv_kernel<F, Bf16, 1, true>
    (row,) = sass_budget.budgets(sass)
    assert row.rows == 1 and row.weights_per_iteration == 16 and row.loop_instructions == 18


def test_rows_template_argument(sass_budget):
    formats = {(2, 1): "e2m1"}
    name = "void fpq::cuda_kernels::gemv_group_kernel<fpq::FormatTraits<2, 1, (fpq::TopCode)2>, float, 8, true>(fpq::GemvArgs)"
    assert sass_budget.describe(name, formats) == ("e2m1", "fp32", 8, "true")
