"""``ds_fpquant.init_inference`` with AutoTP (tp_size 2, two gloo processes on CPU): DeepSpeed shards
the linears first, then each rank quantizes its shards in place; DeepSpeed's forward then multiplies
through the fused op (a QuantizedWeight stands in for the weight), never a dequantized copy. A model
quantized before (``load_quantized``) is sharded as stored: each rank gets its rows or columns of the codes."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autotp_two_ranks(tmp_path):
    worker = Path(__file__).with_name("autotp_worker.py")
    run = subprocess.run([sys.executable, str(worker), str(_free_port()), str(tmp_path)], capture_output=True,
                         text=True, timeout=900)
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
        assert result["pre_max_diff"] <= 1e-5 * result["pre_scale"], result  # the all-reduce's fp32 rounding
        assert result["refused"].startswith("model.layers.0.self_attn.o_proj: columns ") and \
            "cut its groups of 48 columns" in result["refused"], result["refused"]
