"""scripts/sass_budget.py on a canned SASS listing (no nvcc): the steady-state loop is found from the backward
branches, weights per iteration from its FFMA and the rows of x, resources from res-usage and ptxas -v."""

import importlib.util
import sys
from dataclasses import replace
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


# ---- the whole-kernel count (issue 37) -------------------------------------------------------------------------------
#
# A kernel with every construct the counter weighs, blocks A..N (instructions in brackets):
#   A [4] prologue, skips the tile loop to J (a Skip);   B [1] preheader
#   tile loop C..I, header C [2]:
#       staging loop D..F: D [3] skips the load E [2] (zero fill), F [3] stores and turns
#       G [2];  weight loop H [4] (one block, its own latch; LDS.128);  I [3] the tile loop's latch
#   J [2] a conditional EXIT;  K [2] a divergent branch: taken M [1], fall-through L [2] (a store);  N [1] EXIT
#   and nvcc's unreachable self-branch and NOP after it (not counted).
_BODY = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R2, RZ ;
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0030*/               @P0 BRA 0x180 ;
        /*0040*/                   MOV R3, RZ ;
        /*0050*/                   MOV R4, R0 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   ISETP.GE.AND P1, PT, R4, R3, PT ;
        /*0080*/                   LOP3.LUT R6, R4, 0xf, RZ, 0xc0, !PT ;
        /*0090*/               @P1 BRA 0xc0 ;
        /*00a0*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*00b0*/                   FMUL R5, R5, R5 ;
        /*00c0*/                   STS [R4], R5 ;
        /*00d0*/                   IADD3 R4, R4, 0x100, RZ ;
        /*00e0*/              @!P2 BRA 0x70 ;
        /*00f0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   MOV R6, RZ ;
        /*0110*/                   LDS.128 R8, [R4] ;
        /*0120*/                   FFMA R7, R8, R9, R7 ;
        /*0130*/                   FFMA R7, R10, R11, R7 ;
        /*0140*/              @!P3 BRA 0x110 ;
        /*0150*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0160*/                   ISETP.GE.AND P4, PT, R3, R0, PT ;
        /*0170*/              @!P4 BRA 0x50 ;
        /*0180*/                   ISETP.NE.AND P5, PT, R0, RZ, PT ;
        /*0190*/               @P5 EXIT ;
        /*01a0*/                   FADD R7, R7, R7 ;
        /*01b0*/               @P6 BRA 0x1e0 ;
        /*01c0*/                   STG.E desc[UR4][R2.64], R7 ;
        /*01d0*/                   BRA 0x1f0 ;
        /*01e0*/                   MOV R7, RZ ;
        /*01f0*/                   EXIT ;
        /*0200*/                   BRA 0x200;
        /*0210*/                   NOP;
"""
TOY = "_Z10toy_kernelv"
TOY_SASS = f"\tcode for sm_90\n\t\tFunction : {TOY}\n{_BODY}\t\t..........\n"


def _toy_model(sb, tail_taken=1.0, tail_fallthrough=1.0, **overrides):
    """8 warps (4 blocks of 64 threads) for 16 x 64 weights: 3/4 of the warps enter the tile loop, 3 tiles, 4 staging
    iterations per tile (half of them load), 2 weight iterations per tile, half of the warps stay past the EXIT."""
    body = sb.Loop("kernel", 1, [sb.Skip("no tile", run=0.75, match=r"fallthrough: [^|]*BAR"),
                                 sb.Exit("no row", stay=0.5),
                                 sb.Branch("lane-dependent store", taken=tail_taken, fallthrough=tail_fallthrough,
                                           match=r"fallthrough: [^|]*STG")], loops=(
        sb.Loop("tile", lambda d: d.tiles, loops=(
            sb.Loop("staging", 4, [sb.Skip("zero fill", run=lambda d: d.valid, match=r"fallthrough: [^|]*LDG")]),
            sb.Loop("weight", 2))),))
    fields = dict(family="toy", match=r"toy_kernel",
                  describe=lambda name: sb.Instance("", name, "e4m3", "bf16", 1, "-", 8),
                  runs=lambda inst, launch: True, derive=lambda inst, launch: None, body=body,
                  inflight=lambda d, loops: 4096.0, steady="weight", max_m=1,
                  phases=("prologue", "tile", "staging", "weight", "epilogue"))
    fields.update(overrides)
    return sb.KernelModel(**fields)


def _toy_launch():
    from types import SimpleNamespace

    return SimpleNamespace(blocks=4, threads=64, dynamic_smem=4096, tiles=3, valid=0.5)


def test_cfg_of_the_toy_kernel(sass_budget):
    cfg = sass_budget.CFG(sass_budget.split_functions(TOY_SASS)[TOY])
    assert sorted(cfg.blocks) == [0x0, 0x40, 0x50, 0x70, 0xa0, 0xc0, 0xf0, 0x110, 0x150, 0x180, 0x1a0, 0x1c0, 0x1e0,
                                  0x1f0]  # 0x200 (BRA to itself) and the NOP are unreachable
    assert cfg.tree() == "[0x0050..0x0170 [0x0070..0x00e0] [0x0110..0x0140]]"
    assert cfg.blocks[0x190 - 0x10].succs == [("taken", sass_budget.EXIT), ("fallthrough", 0x1a0)]
    top = sass_budget.region(cfg, None)
    assert [x[1] for x in top.branches] == [0x0, 0x180, 0x1a0]
    assert top.ipdom[("b", 0x0)] == ("b", 0x180)  # the skip's join
    assert top.control[("b", 0x1f0)] == [(("b", 0x180), "fallthrough")]  # N runs when the warp stays past the EXIT
    staging = sass_budget.region(cfg, cfg.top_loops[0].children[0])
    assert [x[1] for x in staging.branches] == [0x70] and staging.control[("b", 0xa0)] == [(("b", 0x70), "fallthrough")]
    assert "taken: -" in sass_budget.describe_branch(cfg, staging, ("b", 0x70))


@pytest.mark.parametrize("taken,fallthrough,expected", [(1.0, 1.0, 852), (0.25, 0.75, 847)])
def test_whole_kernel_count_by_hand(sass_budget, taken, fallthrough, expected):
    """Warp executions by hand (8 warps): A 8 x 4 = 32; B 6 x 1 (3/4 enter); C 18 x 2 (6 entries x 3 tiles);
    D 72 x 3 (18 x 4); E 36 x 2 (half of D's); F 72 x 3; G 18 x 2; H 36 x 4 (18 x 2); I 18 x 3; J 8 x 2 (every warp:
    J post-dominates A); K 4 x 2 (half stay); L 4 x 2 and M 4 x 1 when the warp runs both sides (the lanes disagree),
    else 4 x 0.75 x 2 and 4 x 0.25 x 1; N 4 x 1. Sum 852 (847); shared memory: LDS.128 16 B x 32 lanes x 36 reads,
    STS 4 B x 32 x 72 writes."""
    sb = sass_budget
    cfg = sb.CFG(sb.split_functions(TOY_SASS)[TOY])
    count = sb.weigh(cfg, _toy_model(sb, taken, fallthrough), _toy_launch())
    assert count.warp_instructions == expected
    runs = {0x0: 8, 0x40: 6, 0x50: 18, 0x70: 72, 0xa0: 36, 0xc0: 72, 0xf0: 18, 0x110: 36, 0x150: 18, 0x180: 8,
            0x1a0: 4, 0x1c0: 4 * fallthrough, 0x1e0: 4 * taken, 0x1f0: 4}
    assert count.blocks == runs
    assert count.own == {"prologue": 38, "tile": 126, "staging": 504, "weight": 144,
                         "epilogue": expected - 38 - 126 - 504 - 144}
    assert count.total == {"tile": 774, "staging": 504, "weight": 144}
    assert (count.shared_read, count.shared_write) == (16 * 32 * 36, 4 * 32 * 72)
    assert 32 * expected / (16 * 64) == {852: 26.625, 847: 26.46875}[expected]  # lane instructions per weight


def test_a_model_that_does_not_fit_is_refused(sass_budget):
    sb = sass_budget
    cfg = sb.CFG(sb.split_functions(TOY_SASS)[TOY])
    good = _toy_model(sb)
    tile = good.body.loops[0]
    wrong = {
        "one loop short": sb.Loop("kernel", 1, good.body.branches, loops=(
            sb.Loop("tile", 3, loops=(tile.loops[0],)),)),
        "a branch short": sb.Loop("kernel", 1, good.body.branches[:2], loops=good.body.loops),
        "a skip that is two-sided": sb.Loop("kernel", 1, [*good.body.branches[:2], sb.Skip("store", 1.0)],
                                            loops=good.body.loops),
        "an exit that is a branch": sb.Loop("kernel", 1, [sb.Exit("no tile", 1.0), *good.body.branches[1:]],
                                            loops=good.body.loops),
        "a match on the wrong side": sb.Loop("kernel", 1, [*good.body.branches[:2], sb.Branch(
            "store", 1.0, 1.0, match=r"taken: [^|]*STG")], loops=good.body.loops),
    }
    for what, body in wrong.items():
        with pytest.raises(sb.ModelMismatch):
            sb.weigh(cfg, _toy_model(sb, body=body), _toy_launch())
        assert what


def test_whole_kernel_rows_and_residency(sass_budget):
    """One launch row of the toy kernel: 852 x 32 / 1024 = 26.625 per weight; 40 registers x 32 lanes x 2 warps =
    2560 per block (25 fit in 64 Ki registers), 1 KiB + 4 KiB of shared memory (45 fit), 32 blocks of 2 warps: 25
    blocks, 50 warps per SM."""
    sb = sass_budget
    usage = f" Function {TOY}:\n  REG:40 STACK:0 SHARED:1024 LOCAL:0\n"
    model = _toy_model(sb, derive=lambda inst, launch: _toy_launch())
    launch = sb.Launch("e4m3", "bf16", 1, 16, 64, 32)
    (row,) = sb.whole_kernel(sb.split_functions(TOY_SASS), usage, "", models=(model,), launch_list=[launch])
    assert (row.fmt, row.x_dtype, row.m, row.shape, row.group_size, row.scale_format) == ("e4m3", "bf16", 1, "16x64",
                                                                                           32, "fp32")
    assert row.whole_per_weight == 26.625 and row.loop_per_weight == 144 * 32 / 1024
    assert row.phases_per_weight["staging"] == 504 * 32 / 1024
    assert (row.registers, row.smem_bytes_per_block, row.resident_blocks_per_sm, row.resident_warps_per_sm) == (
        40, 5120, 25, 50)
    assert row.inflight_bytes_per_sm == 25 * 4096
    assert row.smem_bytes_per_weight == (16 * 32 * 36 + 4 * 32 * 72) / 1024
    assert sb.resident_blocks(255, 256, 1024) == 1 and sb.resident_blocks(32, 256, 48 << 10) == 4


def test_gemv_model_trip_counts(sass_budget):
    """Today's GEMV at 4096 x 4096, G=128, e4m3 (16-code chunks, 256 per row): M=1 stages a tile of 416 chunks (48 KiB
    / (4 x (20 + 8)), rounded down to 32): 26 x-staging iterations per thread of which the first 16 hold chunks, 13
    scale-staging iterations of which 8 of 13 warp steps hold a real chunk, 8 weight iterations; M=8 stages 4 tiles of
    64 chunks, none zero-filled; NVFP4 (e2m1, G=16) takes the masked instantiation, one 32-code chunk per group."""
    sb = sass_budget
    inst = sb.Instance("", "", "e4m3", "bf16", 1, "true", 8)
    d = sb._gemv_derive(inst, sb.Launch("e4m3", "bf16", 1, 4096, 4096, 128))
    assert (d.tile, d.tiles, d.n_chunks, d.dynamic_smem) == (416, 1, 256, 4 * (416 * 20 + 8 * 416))
    assert (d.x_trips, d.x_valid, d.x_load) == (26, 16 / 26, 16 / 26)
    assert (d.s_trips, d.s_valid, d.weight_trips) == (13, 8 / 13, 8)
    assert (d.x_run, d.s_run, d.row_warps, d.blocks) == (1, 1, 1, 512)
    d8 = sb._gemv_derive(replace(inst, rows=8), sb.Launch("e4m3", "bf16", 8, 4096, 4096, 128))
    assert (d8.tile, d8.tiles, d8.x_trips, d8.x_valid) == (64, 4, 4, 1)
    assert (d8.s_trips, d8.s_valid, d8.weight_trips) == (2, 1, 2)
    ragged = sb._gemv_derive(inst, sb.Launch("e4m3", "bf16", 1, 4100, 4096, 128))
    assert ragged.blocks == 513 and ragged.row_warps == 4100 / 4104
    assert sb.gemv_full(4, 4096, 32) and not sb.gemv_full(4, 4096, 16) and not sb.gemv_full(8, 4096, 96)
    nvfp4 = sb.Launch("e2m1", "bf16", 1, 4096, 4096, 16, "e4m3")
    assert sb._gemv_runs(sb.Instance("", "", "e2m1", "bf16", 1, "false", 4), nvfp4)
