"""Fixtures of the kernel tests: the CUDA kernels executed by the CPU emulation (test_*emulation*.py)."""

import pytest

from unit.ops.fp_quantizer.emulation import cuda_emulation

#: Emulated __CUDA_ARCH__ values: sm_90 (the target), sm_89 (the first with fp8 conversions) and unset
#: (the software codec path every format other than e4m3/e5m2 always takes).
EMULATED_ARCHS = (900, 890, None)


@pytest.fixture(scope="session")
def emulated_ops():
    """{arch: EmulatedCudaOp} for EMULATED_ARCHS, built once per source hash (g++ with ASan and UBSan)."""
    if not cuda_emulation.compiler_available():
        pytest.skip(f"no C++ compiler ({cuda_emulation.CXX}) to build the CUDA emulation")
    ops = cuda_emulation.start_ops(EMULATED_ARCHS)
    yield ops
    for op in ops.values():
        op.close()


@pytest.fixture
def sm90(emulated_ops):
    """The emulated sm_90 op, with default buffer placement and grid cap for each test."""
    op = emulated_ops[900]
    op.misalign, op.max_blocks = {}, 1 << 20
    return op
