"""Pieces of a quantized matrix cut as stored (``ds_fpquant.slicing``): the rows or columns of codes and
scales dequantize to exactly those rows or columns of the whole, and a cut inside a group or block is
refused with the weight's name."""

import pytest
import torch

import ds_fpquant as fpq
from ds_fpquant.tensor.slicing import column_slice, join_rows, row_slice, split_rows

WEIGHTS = [("e4m3", {"group_size": 16}), ("e2m1", {"group_size": 16}), ("e3m2", {"group_size": 12}),
           ("e2m3", {"block": (8, 16)}), ("nvfp4", {}), ("mxfp4", {}), ("e5m2", {"group_size": 16, "scale_format": "e8m0"})]


def _qt(fmt, kwargs, shape=(48, 100)):
    torch.manual_seed(0)
    return fpq.quantize(torch.randn(*shape), fmt, kwargs.get("group_size"), block=kwargs.get("block"),
                        scale_format=kwargs.get("scale_format"))


@pytest.mark.parametrize("fmt,kwargs", WEIGHTS, ids=[w[0] for w in WEIGHTS])
def test_pieces_dequantize_to_the_pieces_of_the_whole(fmt, kwargs):
    qt = _qt(fmt, kwargs)
    whole = fpq.dequantize(qt, torch.float32)
    g = qt.group_size
    for c0, c1 in [(0, g), (g, 100), (2 * g, min(4 * g, 100)), (0, 100)]:
        assert torch.equal(fpq.dequantize(column_slice(qt, c0, c1), torch.float32), whole[:, c0:c1])
    br = qt.block[0] if qt.block else 1
    for r0, r1 in [(0, 8), (8, 48), (16, 24)]:
        assert torch.equal(fpq.dequantize(row_slice(qt, r0 - r0 % br, r1), torch.float32), whole[r0 - r0 % br:r1])
    assert torch.equal(fpq.dequantize(join_rows(split_rows(qt, [16, 32])), torch.float32), whole)


def test_cuts_inside_a_group_or_block_are_refused():
    qt = _qt("e4m3", {"group_size": 16})
    with pytest.raises(ValueError, match=r"layers.0.o_proj: columns 8..15 of a \(48, 100\) weight cut its groups of 16"):
        column_slice(qt, 8, 16, "layers.0.o_proj")
    blocked = _qt("e2m3", {"block": (8, 16)})
    with pytest.raises(ValueError, match="do not start and end on its 8-row block boundaries"):
        row_slice(blocked, 4, 16)
    assert row_slice(blocked, 40, 48).shape == (8, 100) and column_slice(blocked, 96, 100).shape == (48, 4)
