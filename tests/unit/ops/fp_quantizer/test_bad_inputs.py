"""Every row of docs/bad_inputs.md: the call raises that exception with that message, before any
backend is chosen (so before any kernel runs). The table is the documentation and the test data."""

import dataclasses
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize
from ds_fpquant.config import load_config
from ds_fpquant.linear import linear
from ds_fpquant.ops import backends

DOC = Path(__file__).resolve().parents[4] / "docs" / "bad_inputs.md"
ROW = re.compile(r"^\| (\S+) \| `(.+)` \| (\w+) \| (.+) \|$")
EXCEPTIONS = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError,
              "ValidationError": ValidationError}


def _rows():
    rows = [ROW.match(line).groups() for line in DOC.read_text().splitlines() if ROW.match(line)]
    assert len(rows) >= 50, "the table lost rows"
    return rows


def _namespace():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(4, 16)
        q = FP_Quantize(group_size=8)
        buf = q.quantize(torch.randn(4, 8))
        qt = fpq.quantize(x, "e2m1", 16)
    return dict(fpq=fpq, torch=torch, np=np, FP_Quantize=FP_Quantize, load_config=load_config, X=x, q=q, BUF=buf,
                QT=qt, replace=dataclasses.replace, linear=linear)


@pytest.mark.parametrize("api,call,exc,message", _rows(), ids=lambda v: v if len(str(v)) < 60 else None)
def test_bad_input_row(api, call, exc, message, monkeypatch):
    ns = _namespace()

    def no_kernel(*args, **kwargs):
        raise AssertionError(f"{call} reached backend selection instead of raising {exc}")

    monkeypatch.setattr(backends, "resolve", no_kernel)
    with pytest.raises(EXCEPTIONS[exc]) as info:
        eval(call, ns)
    assert message.replace("&#124;", "|") in str(info.value)
    assert issubclass(EXCEPTIONS[exc], (ValueError, TypeError, NotImplementedError))
