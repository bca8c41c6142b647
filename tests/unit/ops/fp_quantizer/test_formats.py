"""SPEC 1: the format table agrees with the SPEC table, ml_dtypes, and the decode of every code."""

import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from unit.oracle import ORACLE_FORMATS, assert_bitwise_equal, code_values

import ds_fpquant as fpq
from ds_fpquant.numerics.codec import decode_table

SPEC_PATH = Path(__file__).resolve().parents[4] / "docs" / "spec.md"


def _parse_power(text: str) -> float:
    text = text.strip()
    m = re.fullmatch(r"2\^(-?\d+)", text)
    return 2.0**int(m.group(1)) if m else float(text)


def _spec_rows():
    rows = {}
    for line in SPEC_PATH.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"`e\dm\d`", cells[0]):
            rows[cells[0].strip("`")] = cells
    return rows


def _nan_codes_from_spec(cell: str, ebits: int, mbits: int):
    """'S.1111.111' / 'S.11111.{01,10,11}' / 'none' -> set of codes (both signs)."""
    if cell == "none":
        return set()
    m = re.fullmatch(r"S\.([01]+)\.(?:\{([01,]+)\}|([01]+))", cell)
    assert m, cell
    exp = int(m.group(1), 2)
    mants = m.group(2).split(",") if m.group(2) else [m.group(3)]
    sign = 1 << (ebits + mbits)
    return {s | (exp << mbits) | int(man, 2) for man in mants for s in (0, sign)}


def test_format_table_matches_spec_table():
    """SPEC 1: bits, exp, man, bias, max, min normal, min subnormal, Inf, NaN codes."""
    rows = _spec_rows()
    assert set(rows) == set(fpq.FORMATS), "the SPEC table and formats.FORMATS list different formats"
    for name, cells in rows.items():
        f = fpq.FORMATS[name]
        bits, exp, man, bias = (int(c) for c in cells[1:5])
        assert (f.bits, f.ebits, f.mbits, f.bias) == (bits, exp, man, bias), name
        assert f.fmax == _parse_power(cells[5]), name
        assert f.min_normal == _parse_power(cells[6]), name
        assert f.min_subnormal == _parse_power(cells[7]), name
        assert f.has_inf == (cells[8] == "yes"), name
        nan_codes = {c for c, v in enumerate(f.decode_table) if math.isnan(v)}
        assert nan_codes == _nan_codes_from_spec(cells[9], exp, man), name


@pytest.mark.parametrize("name", [n for n, v in ORACLE_FORMATS.items() if v[2] is not None])
def test_format_table_matches_ml_dtypes(name):
    f = fpq.FORMATS[name]
    info = ml_dtypes.finfo(ORACLE_FORMATS[name][2])
    assert f.bits == info.bits
    assert f.fmax == float(info.max)
    assert f.min_normal == float(info.smallest_normal)
    assert f.min_subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("name", list(fpq.FORMATS))
def test_decode_every_code(name):
    """SPEC 5: decode of every code equals the oracle (ml_dtypes; bit formula for e4m7)."""
    ours = decode_table(fpq.FORMATS[name]).numpy()
    assert_bitwise_equal(ours, code_values(name).astype(np.float32), f"decode table of {name}")


def test_e4m7_limits():
    """SPEC 1: e4m7 has no NaN/Inf; max (2 - 2^-7) * 2^8 = 510, min subnormal 2^-13."""
    f = fpq.FORMATS["e4m7"]
    table = f.decode_table
    assert max(table) == 510.0 == f.fmax
    assert min(v for v in table if v > 0) == 2.0**-13
    assert not any(math.isnan(v) or math.isinf(v) for v in table)


def test_e4m3_max_code_is_not_nan_as_torch_float8():
    """The largest finite e4m3 code views as 448 in torch.float8_e4m3fn (DeepSpeed's 480 does not)."""
    f = fpq.FORMATS["e4m3"]
    code = torch.tensor([f.max_code], dtype=torch.uint8)
    assert code.view(torch.float8_e4m3fn).float().item() == 448.0
    code = torch.tensor([fpq.FORMATS["e5m2"].max_code], dtype=torch.uint8)
    assert code.view(torch.float8_e5m2).float().item() == 57344.0


def test_unknown_format_lists_allowed():
    with pytest.raises(ValueError, match=r"fmt='fp8'.*allowed: e4m3, e5m2, e3m2, e2m3, e2m1, e4m7"):
        fpq.get_format("fp8")
    with pytest.raises(TypeError, match="fmt must be a str"):
        fpq.get_format(8)
