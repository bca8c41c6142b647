"""The quantized linear on CUDA tensors (skipped without a CUDA device): the GEMV kernel up to 8 rows of x
(SPEC 8.1's formula: the bound with the exact weights), panels of decoded weight rows + cuBLAS beyond (the weights
rounded to x's dtype), against the fp64 bound every linear path is held to.
The same GEMV kernel runs in the CPU emulation in CI (ops/fp_quantizer/test_cuda_emulation_linear.py)."""

import dataclasses

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear import weight_only as linear_module
from ds_fpquant.ops import backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda(qt):
    ts = None if qt.tensor_scale is None else qt.tensor_scale.cuda()
    return dataclasses.replace(qt, codes=qt.codes.cuda(), scales=qt.scales.cuda(), tensor_scale=ts)


@pytest.mark.parametrize("fmt,kwargs", [("e4m3", {"group_size": 128}), ("e2m1", {"group_size": 32}),
                                        ("e3m2", {"group_size": 7}), ("e4m7", {"group_size": 100}),
                                        ("mxfp4", {}), ("nvfp4", {}), ("e4m3", {"block": (128, 128)})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 300])
def test_cuda_linear_within_bound(monkeypatch, fmt, kwargs, dtype, m):
    monkeypatch.setattr(linear_module, "CUDA_PANEL_BYTES", 64 * 300 * 4)  # several panels at every dtype
    w = torch.randn(300, 300)
    qt = fpq.quantize(w, fmt, **kwargs)
    x, bias = torch.randn(m, 300).to(dtype), torch.randn(300)
    y = linear(x.cuda(), _cuda(qt), bias.cuda())
    assert y.device.type == "cuda" and y.dtype == dtype
    gemv = m <= linear_module.GEMV_MAX_ROWS
    assert_linear_within_bound(x, qt, bias, y.cpu(), weights="exact" if gemv else "rounded")


@pytest.mark.parametrize("layout", [{"group_size": 128}, {"block": (128, 128)}])
@pytest.mark.parametrize("m", [1, 16, 100])
def test_cuda_w8a8_matches_the_cpu_math(layout, m):
    """torch._scaled_mm's blockwise FP8 GEMM (or, where it cannot run, the logged fallback) against the fp64
    product of the e4m3-quantized activations and the weight."""
    qt = fpq.quantize(torch.randn(256, 384), "e4m3", **layout)
    x, bias = torch.randn(m, 384), torch.randn(256)
    y = linear(x.cuda(), _cuda(qt), bias.cuda(), activation="e4m3")
    xd = fpq.dequantize(fpq.quantize(x, "e4m3", 128), torch.float32)
    assert_linear_within_bound(xd, qt, bias, y.cpu())


def _graph_nodes(graph: torch.cuda.CUDAGraph) -> int:
    """Nodes of a captured graph (kept with ``keep_graph=True``): cudaGraphGetNodes of the CUDA runtime torch loaded."""
    import ctypes

    libs = [lib for lib in open("/proc/self/maps").read().split() if "libcudart" in lib]
    cudart = ctypes.CDLL(libs[0] if libs else "libcudart.so")
    count = ctypes.c_size_t(0)
    assert cudart.cudaGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(count)) == 0
    return count.value


def test_cuda_linear_split_k_workspace_created_once_one_graph_node():
    """Issue 42: no memset per call. A 4096x4096 layer at M=1 splits K (64 tiles on the device's SMs); its counters are
    the launcher's per device and stream, created once (the binding reports it) and reused by every later call, so a
    captured call is one kernel node."""
    op, reason = backends.load_op("cuda")
    assert op is not None, reason
    device = torch.cuda.current_device()
    qt = _cuda(fpq.quantize(torch.randn(4096, 4096), "e4m3", 128))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = linear(x, qt)
    torch.cuda.synchronize()
    first = op.gemv_workspace(device)
    assert first["created"] >= 1 and first["capacity"] >= 64 and first["counters"] != 0
    for _ in range(3):
        assert torch.equal(linear(x, qt), y)  # the same bits: the counters were left at zero
    torch.cuda.synchronize()
    assert op.gemv_workspace(device) == first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(x, qt)  # the capture stream's own buffer, created outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        y_graph = linear(x, qt)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)
    assert _graph_nodes(graph) == 1
    created = op.gemv_workspace(device)["created"]
    fresh = torch.cuda.Stream()  # its first call inside the capture: the buffer is created (and zeroed) now, no node
    fresh.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=fresh):
        y_graph = linear(x, qt)
    assert op.gemv_workspace(device)["created"] == created + 1
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y) and _graph_nodes(graph) == 1
