"""Fixtures of the kernel tests: the CUDA kernels executed by the CPU emulation (test_*emulation*.py)."""

import pytest
from unit.ops.fp_quantizer.emulation import cuda_emulation

#: Emulated __CUDA_ARCH__ values: sm_90 (the target), sm_89 (the first with fp8 conversions) and unset
#: (the software codec path every format other than e4m3/e5m2 always takes).
EMULATED_ARCHS = (900, 890, None)


@pytest.fixture(scope="session")
def _emulated_ops_session():
    if not cuda_emulation.compiler_available():
        pytest.skip(f"no C++ compiler ({cuda_emulation.CXX}) to build the CUDA emulation")
    ops = cuda_emulation.start_ops(EMULATED_ARCHS)
    yield ops
    for op in ops.values():
        op.close()


@pytest.fixture
def emulated_ops(_emulated_ops_session):
    """{arch: EmulatedCudaOp} for EMULATED_ARCHS (g++ with ASan and UBSan, built once per source hash), each
    with default buffer placement, grid cap, SM count (the GEMV's plan) and stream for the test."""
    for op in _emulated_ops_session.values():
        op.misalign, op.max_blocks, op.num_sms, op.stream = {}, 1 << 20, 132, 0
    return _emulated_ops_session


@pytest.fixture
def sm90(emulated_ops):
    """The emulated sm_90 op."""
    return emulated_ops[900]


@pytest.fixture
def quiet_fallback():
    """The torch fallback's one-time RuntimeWarning (no compiled op for a device) is not the test's subject."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
