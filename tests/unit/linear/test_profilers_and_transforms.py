"""Issue 43 (4): what profilers and function transforms see of the quantized linear. ``FlopCounterMode`` (what
transformers and accelerate count FLOPs with) counts ``2 M N K`` per call, as for the dense ``F.linear``;
``torch.func.vmap`` runs it (the ops' vmap rule); ``torch.func.grad`` raises a clear ``NotImplementedError``; and
every module of the package compiles and imports with invalid-escape warnings as errors."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear.weights import QuantizedWeight

M, N, K = 6, 48, 128
CALLS = {"weight-only": {}, "w8a8": {"activation": "e4m3"},
         "static-w8a8": {"activation": "e4m3", "input_scale": torch.tensor(0.02)}}


def _weight():
    return fpq.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(1)), "e4m3", 128)


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("call", list(CALLS))
def test_flop_counter_counts_the_dense_matmul(call):
    qt, x, bias = _weight(), _x(2, 3, K), torch.randn(N)
    kwargs = CALLS[call]
    dense = _flops(lambda: torch.nn.functional.linear(x, torch.randn(N, K), bias))
    assert dense == 2 * M * N * K
    with torch.no_grad():
        assert _flops(lambda: linear(x, qt, bias, **kwargs)) == dense
    assert _flops(lambda: linear(x, qt, bias, **kwargs)) == dense  # x without grad, grad mode on
    # the backward's matmul by the dequantized weight counts as the dense backward's
    xg = x.clone().requires_grad_()
    assert _flops(lambda: linear(xg, qt, bias, **kwargs).sum().backward()) == 2 * dense


def test_flop_counter_sees_layers_and_stand_ins():
    layer = fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(K, N), "e4m3", 32)
    x = _x(M, K)
    with torch.no_grad():
        assert _flops(lambda: layer(x)) == 2 * M * N * K
        w = QuantizedWeight(_weight(), torch.float32)
        assert _flops(lambda: x @ w.T) == 2 * M * N * K


@pytest.mark.parametrize("call", list(CALLS))
def test_vmap_over_x_and_over_biases(call):
    qt, kwargs = _weight(), CALLS[call]
    x = _x(3, 5, K)
    with torch.no_grad():
        direct = linear(x, qt, **kwargs)
        assert torch.equal(torch.func.vmap(lambda xi: linear(xi, qt, **kwargs))(x), direct)
        assert torch.equal(torch.func.vmap(lambda xi: linear(xi, qt, **kwargs), in_dims=1)(x),
                           linear(x.transpose(0, 1), qt, **kwargs))
        biases = torch.randn(3, N)
        batched = torch.func.vmap(lambda xi, b: linear(xi, qt, b, **kwargs))(x, biases)
        assert torch.equal(batched, torch.stack([linear(x[i], qt, biases[i], **kwargs) for i in range(3)]))


def test_vmap_of_a_quantized_layer():
    layer = fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(K, N), "e2m1", 32)
    x = _x(4, 2, K)
    with torch.no_grad():
        assert torch.equal(torch.func.vmap(layer)(x), layer(x))


def test_func_grad_names_the_limitation():
    qt = _weight()
    for fn in (lambda x: linear(x, qt).sum(), lambda x: torch.func.vmap(lambda r: linear(r, qt))(x).sum()):
        with pytest.raises(NotImplementedError, match="torch.func.grad.*loss.backward"):
            torch.func.grad(fn)(_x(2, K))
    x = _x(2, K).requires_grad_()  # torch.autograd gives the gradient
    linear(x, qt).sum().backward()
    assert x.grad.shape == (2, K)


def test_every_module_compiles_and_imports_with_escape_warnings_as_errors():
    """Compiled from source (a cached .pyc hides the warning): an invalid escape such as ``\\ `` in a docstring is a
    DeprecationWarning in Python 3.11, a SyntaxWarning from 3.12, an error later."""
    root = pathlib.Path(fpq.__file__).parent
    script = (
        "import importlib, pathlib, pkgutil, sys, warnings, ds_fpquant\n"
        "root = pathlib.Path(sys.argv[1])\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('error', SyntaxWarning)\n"
        "    warnings.simplefilter('error', DeprecationWarning)\n"
        "    for path in sorted(root.rglob('*.py')):\n"
        "        compile(path.read_text(), str(path), 'exec')\n"
        "for info in pkgutil.walk_packages(ds_fpquant.__path__, 'ds_fpquant.'):\n"
        "    if not info.name.endswith('__main__'):  # the CLI entry point runs when imported\n"
        "        importlib.import_module(info.name)\n"
        "print('checked', len(list(root.rglob('*.py'))))\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-W", "error::SyntaxWarning", "-c", script, str(root)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked" in done.stdout


def test_a_source_with_an_invalid_escape_fails_the_check(tmp_path):
    """The check above can fail: the same compile with ``\\ `` in a docstring raises."""
    source = 'def f():\n    """``block``\\ s"""\n'
    done = subprocess.run([sys.executable, "-W", "error::SyntaxWarning", "-W", "error::DeprecationWarning", "-c",
                           f"compile({source!r}, 'f.py', 'exec')"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "invalid escape sequence" in done.stderr
