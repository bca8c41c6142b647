"""Fixtures of the linear-layer tests."""

import pytest

import ds_fpquant as fpq


@pytest.fixture
def patched():
    """DeepSpeed's FP_Quantize name (and init_inference) resolve to ds_fpquant's for the test."""
    fpq.patch_deepspeed()
    yield
    fpq.unpatch_deepspeed()
