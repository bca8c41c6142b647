"""Issue 29: per-tensor and per-channel scaling (SPEC 2). A block or group side at least the matrix side means one
scale along that side, with no padding allocation: ``block=(2**20, 2**20)`` gives the bits of ``block=(N, K)``;
``granularity="tensor"`` / ``"channel"`` name them in the API, the ``fp_quantization`` section, ``quantize_checkpoint``
and the command line; the result survives linear, slicing, state dicts and the checkpoint round trip."""

import copy
import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from unit import oracle
from unit.tiny_models import tiny_llama

import ds_fpquant as fpq
from ds_fpquant.checkpoint import writer as checkpoint
from ds_fpquant.cli.quantize import quantize_main
from ds_fpquant.linear import linear
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.numerics.formats import FORMATS, WHOLE
from ds_fpquant.tensor.slicing import column_slice, join_rows, row_slice, split_rows

#: Every element format takes fp32 scales (SPEC 3.1).
FMTS = list(FORMATS)
SHAPES = [(5, 7), (300, 130), (1, 1), (64, 33), (2, 256)]
BACKENDS = ["torch", "cpu"]


def _randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _same(a, b):
    assert torch.equal(a.codes, b.codes) and a.scales.dtype == b.scales.dtype
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))  # bits, NaN included


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_whole_side_is_the_exact_size(shape, fmt, backend):
    n, k = shape
    x = _randn(shape, seed=n * 1000 + k, dtype=torch.bfloat16)
    exact = fpq.quantize(x, fmt, block=(n, k), backend=backend)
    for block in [(2**20, 2**20), (n + 1, k + 3), (WHOLE, WHOLE)]:
        big = fpq.quantize(x, fmt, block=block, backend=backend)
        _same(big, exact)
        assert big.scales.shape == (1, 1) and big.block == block  # recorded as given
        assert big.granularity == "tensor"
        assert torch.equal(big.dequantize().view(torch.int16), exact.dequantize().view(torch.int16))
    tensor = fpq.quantize(x, fmt, granularity="tensor", backend=backend)
    _same(tensor, exact)
    assert tensor.block == (WHOLE, WHOLE) and tensor.group_size == WHOLE
    # one side whole, the other in blocks / groups: the same as naming the exact side
    bc = max(1, k // 3)
    _same(fpq.quantize(x, fmt, block=(2**20, bc), backend=backend), fpq.quantize(x, fmt, block=(n, bc), backend=backend))
    _same(fpq.quantize(x, fmt, block=(2, 2**20), backend=backend), fpq.quantize(x, fmt, block=(2, k), backend=backend))
    channel = fpq.quantize(x, fmt, granularity="channel", backend=backend)
    _same(channel, fpq.quantize(x, fmt, group_size=k, backend=backend))
    assert channel.scales.shape == (n, 1) and channel.block is None and channel.granularity == "channel"
    _same(fpq.quantize(x, fmt, block=(1, 2**20), backend=backend), fpq.quantize(x, fmt, block=(1, k), backend=backend))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_e8m0_scales_and_stochastic_rounding_take_whole_sides(fmt):
    x = _randn((300, 130), seed=3)
    for kwargs in [dict(scale_format="e8m0"), dict(scale_format="e8m0", scale_rounding="floor"),
                   dict(rounding="stochastic", seed=11)]:
        _same(fpq.quantize(x, fmt, granularity="tensor", **kwargs), fpq.quantize(x, fmt, block=(300, 130), **kwargs))
        _same(fpq.quantize(x, fmt, granularity="channel", **kwargs), fpq.quantize(x, fmt, group_size=130, **kwargs))


def test_faults_mark_the_one_scale():
    x = _randn((6, 10), seed=4)
    x[2, 3] = float("nan")
    qt = fpq.quantize(x, "e2m1", granularity="tensor")  # no NaN code: the one scale is NaN (SPEC 3.3)
    assert qt.scales.shape == (1, 1) and torch.isnan(qt.scales).all()
    rows = fpq.quantize(x, "e2m1", granularity="channel")
    assert torch.isnan(rows.scales[2, 0]) and torch.isfinite(rows.scales[[0, 1, 3, 4, 5]]).all()


class _Allocations(TorchDispatchMode):
    """The bytes of the largest tensor any torch op (the compiled op's included) returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_block_allocates_within_the_matrix(backend):
    n = k = 4096
    x = _randn((n, k), seed=5)
    with _Allocations() as seen:
        qt = fpq.quantize(x, "e4m3", block=(2**20, 2**20), backend=backend)
        y = qt.dequantize(torch.float32, backend=backend)
    assert qt.scales.shape == (1, 1) and qt.codes.shape == (n, k)
    # padding to whole blocks would have asked for 2^40 elements; nothing is larger than the matrix at 8 bytes an
    # element (the torch reference's int64 codes)
    assert seen.largest <= 8 * n * k, seen.largest
    assert torch.equal(y, fpq.quantize(x, "e4m3", block=(n, k), backend=backend).dequantize(torch.float32))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(5, 7), (300, 130), (3, 1)])
def test_channel_and_tensor_against_the_oracle(shape, fmt):
    """Codes (ml_dtypes casts), scales and values of the numpy oracle: per-channel is one group of K per row,
    per-tensor one fp32 scale from the amax of the whole matrix."""
    x = _randn(shape, seed=7)
    xn = oracle.to_numpy32(x)
    packed, scales, deq = oracle.quantize_rows(xn, fmt, shape[1])
    qt = fpq.quantize(x, fmt, granularity="channel")
    oracle.assert_bitwise_equal(qt.codes, packed, "per-channel codes")
    oracle.assert_bitwise_equal(qt.scales, scales, "per-channel scales")
    oracle.assert_bitwise_equal(qt.dequantize(torch.float32), deq, "per-channel values")
    s = oracle.scales_fp32(xn.reshape(1, 1, -1), fmt).reshape(())
    packed, _, deq = oracle.quantize_rows(xn, fmt, shape[1], given_scale=s)
    qt = fpq.quantize(x, fmt, granularity="tensor")
    oracle.assert_bitwise_equal(qt.codes, packed, "per-tensor codes")
    oracle.assert_bitwise_equal(qt.scales, np.full((1, 1), s, np.float32), "per-tensor scale")
    oracle.assert_bitwise_equal(qt.dequantize(torch.float32), deq, "per-tensor values")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e3m2"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_linear_is_the_exact_size_linear(granularity, fmt, backend):
    n, k = 48, 40
    w, x = _randn((n, k), seed=8), _randn((3, k), seed=9)
    qt = fpq.quantize(w, fmt, granularity=granularity)
    exact = fpq.quantize(w, fmt, **({"block": (n, k)} if granularity == "tensor" else {"group_size": k}))
    for activations in (x, x.to(torch.bfloat16), _randn((20, k), seed=10)):  # GEMV-sized and panel-sized inputs
        assert torch.equal(linear(activations, qt, backend=backend), linear(activations, exact, backend=backend))
    ref = torch.nn.functional.linear(x, qt.dequantize(torch.float32))
    torch.testing.assert_close(linear(x, qt, backend=backend), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_slicing_keeps_the_one_scale(granularity):
    w = _randn((12, 16), seed=12)
    qt = fpq.quantize(w, "e2m1", granularity=granularity)
    y = qt.dequantize(torch.float32)
    top, bottom = split_rows(qt, [5, 7])  # per-tensor: each piece keeps the one scale
    assert torch.equal(top.dequantize(torch.float32), y[:5]) and torch.equal(bottom.dequantize(torch.float32), y[5:])
    for piece in (top, bottom, row_slice(qt, 3, 9)):
        piece.validate()
    assert torch.equal(row_slice(qt, 3, 9).dequantize(torch.float32), y[3:9])
    joined = join_rows([top, bottom])
    joined.validate()
    assert torch.equal(joined.dequantize(torch.float32), y)
    left, right = column_slice(qt, 0, 8), column_slice(qt, 8, 16)  # one group per row: cut on whole pack units
    assert torch.equal(left.dequantize(torch.float32), y[:, :8]) and torch.equal(right.dequantize(torch.float32), y[:, 8:])
    with pytest.raises(ValueError, match="pack unit of 2 codes"):
        column_slice(qt, 3, 16)
    # two per-tensor matrices of their own scales stack as per-row scales, which dequantize to the same values
    other = fpq.quantize(_randn((4, 16), seed=13), "e2m1", granularity=granularity)
    both = join_rows([qt, other])
    both.validate()
    assert torch.equal(both.dequantize(torch.float32), torch.cat([y, other.dequantize(torch.float32)]))


def test_apply_section_overrides_and_state_dict():
    model = tiny_llama()
    section = {"fmt": "e4m3", "granularity": "tensor", "modules": {"mlp": {"granularity": "channel"},
                                                                    "v_proj": {"group_size": 16}}}
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": section})
    layers = {name: m for name, m in quantized.named_modules() if isinstance(m, FPQuantizedLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        qt = layer.quantized_weight
        n, k = qt.shape
        weight = model.get_submodule(name).weight.detach()
        if ".mlp." in name:
            assert qt.scales.shape == (n, 1) and qt.group_size == WHOLE and "granularity=channel" in repr(layer)
            _same(qt, fpq.quantize(weight, "e4m3", group_size=k))
        elif "v_proj" in name:
            assert qt.scales.shape == (n, k // 16)
        else:
            assert qt.scales.shape == (1, 1) and qt.block == (WHOLE, WHOLE) and "granularity=tensor" in repr(layer)
            _same(qt, fpq.quantize(weight, "e4m3", block=(n, k)))
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = quantized(ids).logits
        fresh = fpq.apply(copy.deepcopy(model), {"fp_quantization": section})
        fresh.load_state_dict(quantized.state_dict())
        assert torch.equal(fresh(ids).logits, out)
        cos = torch.nn.functional.cosine_similarity(out.flatten(), model(ids).logits.flatten(), dim=0)
    assert cos > 0.99
    layer = FPQuantizedLinear.from_linear(model.model.layers[0].self_attn.q_proj, "e3m2", granularity="tensor")
    assert layer.quantized_weight.scales.shape == (1, 1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = tiny_llama()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path, model


#: (fmt, granularity, layout, weight_block_size, group_size in the ds_fpquant layout)
CHECKPOINTS = [("e4m3", "tensor", "fp8", [WHOLE, WHOLE], None), ("e4m3", "channel", "fp8", [1, WHOLE], None),
               ("e2m1", "tensor", "ds_fpquant", [WHOLE, WHOLE], WHOLE), ("e3m2", "channel", "ds_fpquant", None, WHOLE)]


@pytest.mark.parametrize("fmt,granularity,method,block,group_size", CHECKPOINTS,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CHECKPOINTS])
def test_checkpoint_round_trip(llama_dir, tmp_path, fmt, granularity, method, block, group_size):
    src, model = llama_dir
    summary = checkpoint.quantize_checkpoint(src, tmp_path / "q", fmt, granularity=granularity, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == method and qc["weight_block_size"] == block and summary["kept_partial"] == []
    if method == "ds_fpquant":
        assert qc["group_size"] == group_size
    reference = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": fmt, "granularity": granularity}})
    loaded = fpq.load_quantized(tmp_path / "q")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    layers = [(n, m) for n, m in loaded.named_modules() if isinstance(m, FPQuantizedLinear)]
    assert len(layers) == 14
    for name, layer in layers:
        qt, expected = layer.quantized_weight, reference.get_submodule(name).quantized_weight
        assert torch.equal(qt.codes, expected.codes) and torch.equal(qt.scales, expected.scales.reshape(qt.scales.shape))
        assert qt.scales.shape == ((1, 1) if granularity == "tensor" else (qt.shape[0], 1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    # save_quantized: layers of every shape count as one setting; the saved model loads back as it was
    for source, out in [(loaded, "saved"), (reference, "applied")]:
        saved = checkpoint.save_quantized(source, tmp_path / out)
        assert saved["quantization_config"]["weight_block_size"] == block
        again = fpq.load_quantized(tmp_path / out)
        with torch.no_grad():
            assert torch.equal(again(ids).logits, reference(ids).logits)


def test_cli_granularity(llama_dir, tmp_path, capsys):
    src, _ = llama_dir
    assert quantize_main([str(src), str(tmp_path / "q"), "--granularity", "channel", "--no-progress"]) == 0
    assert "one scale per output row" in capsys.readouterr().out
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [1, WHOLE]
    loaded = fpq.load_quantized(tmp_path / "q")
    assert loaded.model.layers[0].mlp.up_proj.quantized_weight.scales.shape == (128, 1)
    for bad in (["--granularity", "tensor", "--block", "8", "8"], ["--granularity", "matrix"],
                ["--granularity", "tensor", "--fmt", "mxfp4"]):
        with pytest.raises(SystemExit):
            quantize_main([str(src), str(tmp_path / "r"), *bad, "--no-progress"])
        assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(granularity="tensor", block=(4, 4)), ValueError, r"granularity='tensor' .*block=\(4, 4\)"),
    (dict(granularity="channel", group_size=8), ValueError, "granularity='channel' .*group_size=8"),
    (dict(granularity="matrix"), ValueError, "granularity='matrix' is not supported; allowed: 'tensor', 'channel'"),
    (dict(granularity=1), TypeError, "granularity must be a str"),
    (dict(granularity="tensor", grouping="flat"), ValueError, "granularity='tensor'.*grouping must be 'row'"),
    (dict(fmt="nvfp4", granularity="channel"), ValueError, "fmt='nvfp4' fixes groups of 16.*granularity='channel'"),
    (dict(block=(0, 4)), ValueError, r"block\[0\]=0"),
    (dict(block=(4, 0)), ValueError, r"block\[1\]=0"),
    (dict(block=(2.0, 4)), TypeError, r"block\[0\] must be an int"),
    (dict(block=(4, "all")), TypeError, r"block\[1\] must be an int"),
    (dict(group_size=0), ValueError, "group_size=0"),
    (dict(group_size=1.5, granularity="tensor"), TypeError, "group_size must be an int"),
])
def test_bad_settings(kwargs, error, match):
    kwargs = {"fmt": "e4m3", **kwargs}
    with pytest.raises(error, match=match):
        fpq.quantize(_randn((4, 8)), **kwargs)


def test_bad_settings_elsewhere(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="granularity='tensor' needs a 2-D tensor"):
        fpq.quantize(_randn((2, 3, 4)), "e4m3", granularity="tensor")
    assert fpq.quantize(_randn((2, 3, 4)), "e4m3", granularity="channel").scales.shape == (2, 3, 1)
    for section, match in [({"granularity": "tensor", "group_size": 32}, "granularity='tensor'.*group_size=32"),
                           ({"granularity": "rows"}, "granularity"), ({"block": [0, 128]}, "block"),
                           ({"fmt": "mxfp4", "granularity": "tensor"}, "fmt='mxfp4'"),
                           ({"modules": {"mlp": {"block": [128, 0]}}}, "block")]:
        with pytest.raises(ValueError, match=match):
            fpq.apply(torch.nn.Sequential(torch.nn.Linear(8, 8)), {"fp_quantization": section})
    src, _ = llama_dir
    with pytest.raises(ValueError, match="granularity='channel'"):
        checkpoint.quantize_checkpoint(src, tmp_path / "q", granularity="channel", block=(8, 8), progress=False)
    with pytest.raises(ValueError, match="granularity='tensor'"):
        checkpoint.quantize_checkpoint(src, tmp_path / "q", granularity="tensor", group_size=8, progress=False)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_transformers_fp8_loader_reads_the_same_weights(llama_dir, tmp_path, granularity):
    """transformers' CPU FP8 loader infers the block from the scales' shape (rows // scale_rows): it reads the
    per-tensor ``[2^31 - 1, 2^31 - 1]`` and per-channel ``[1, 2^31 - 1]`` blocks as the exact sides."""
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it
    import transformers

    src, _ = llama_dir
    checkpoint.quantize_checkpoint(src, tmp_path / "q", "e4m3", granularity=granularity, progress=False)
    loaded = fpq.load_quantized(tmp_path / "q")
    ours = {f"{n}.weight": m.quantized_weight.dequantize(torch.float32) for n, m in loaded.named_modules()
            if isinstance(m, FPQuantizedLinear)}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).state_dict()
    assert len(ours) == 14
    assert [k for k, w in ours.items() if not torch.equal(theirs[k], w)] == []
