"""``ds_fpquant.init_inference`` with AutoTP (tp_size 2, two gloo processes on CPU): DeepSpeed shards
the linears first, then each rank quantizes its shards in place; DeepSpeed's forward then multiplies
through the fused op (a QuantizedWeight stands in for the weight), never a dequantized copy. A model
quantized before (``load_quantized``) is sharded as stored: each rank gets its rows or columns of the codes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from unit.linear_bound import assert_rms_errors_comparable

pytest.importorskip("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autotp_two_ranks(tmp_path):
    worker = Path(__file__).with_name("autotp_worker.py")
    tests = str(Path(__file__).resolve().parents[3])  # the worker imports unit.linear_bound, as the tests do
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p))
    run = subprocess.run([sys.executable, str(worker), str(_free_port()), str(tmp_path)], capture_output=True,
                         text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["layers"] == 14 and result["quantized"] == 14  # 2 layers x (4 attention + 3 MLP)
        assert result["exact"], "each rank's codes are quantize(its shard)"
        assert result["cos"] > 0.999 and result["generated"] == [1, 11] and result["weight_released"]
        assert result["dequantized_in_forward"] == 0, "the sharded layers multiply through the fused op"
    assert results[0]["cos"] == results[1]["cos"]  # the all-reduce gives both ranks the same logits
    for result in results:  # a pre-quantized model (load_quantized) sharded by AutoTP: each rank its stored slice
        assert result["pre_sliced"] == 14 and result["pre_exact"] == 14
        # tp=2 splits each row-parallel sum in two and all-reduces: only the fp32 order differs from tp=1
        assert_rms_errors_comparable(result["pre_error"], result["whole_error"], result["exact_rms"])
        assert result["refused"].startswith("model.layers.0.self_attn.o_proj: columns ") and \
            "cut its groups of 48 columns" in result["refused"], result["refused"]
