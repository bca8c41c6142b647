"""``ds-fpquant report``: DeepSpeed's op report with this project's rows; --build self-tests the ops."""

import subprocess
import sys

import torch

from ds_fpquant.cli import report


def test_report_build_cli():
    run = subprocess.run([sys.executable, "-m", "ds_fpquant", "report", "--build"], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "DeepSpeed C++/CUDA extension op report" in out and "DeepSpeed general environment info" in out
    assert "ds_fpquant_cpu ........ PASS (all 6 formats bit-exact on cpu" in out
    if torch.version.cuda is None:
        assert "ds_fpquant ............ SKIP (not compatible: torch" in out and "CPU-only build" in out
    assert out.count("cpu tensors ..... compiled cpu op") == 4  # quantize, dequantize, FP_Quantize, linear


def test_deepspeed_op_table_restored(capsys):
    from deepspeed import env_report
    before_ops, before_installed = dict(env_report.ALL_OPS), dict(env_report.installed_ops)
    report.deepspeed_report(report._builders())
    assert "ds_fpquant_cpu" in capsys.readouterr().out
    assert dict(env_report.ALL_OPS) == before_ops and dict(env_report.installed_ops) == before_installed
