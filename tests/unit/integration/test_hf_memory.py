"""Issue 45: ``from_pretrained`` through ds_fpquant never holds a full-precision copy of a quantized weight. A Llama
whose linear weights are 192 MiB in bf16 (6 layers of 1024 x 4096), loaded in child processes whose anonymous memory
(``RssAnon`` above the imports, sampled every 20 ms by ``scripts/checkpoint_memory.py``'s sampler) is compared, in
the same run, with transformers' own ``from_pretrained`` of the full-precision checkpoint (whose weights are
memory-mapped, not anonymous: what it adds is the loader's own overhead) and with ``load_quantized``:

- a quantized checkpoint (MXFP4) loads in at most that overhead plus the checkpoint's bytes, and in less than the
  full-precision weights (so no full-precision copy of them is ever held at once);
- quantizing while loading takes no more than ``load_quantized(SRC, fp_quantization=...)`` (the same reading code)
  plus that overhead (``docs/checkpoints.md``, "Memory": both hold more than one tensor at the peak).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers

from ds_fpquant.checkpoint.writer import quantize_checkpoint

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "checkpoint_memory.py"
MIB = 2**20

CHILD = """
import sys, torch, transformers, ds_fpquant
from ds_fpquant import DsFpQuantConfig
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))
path, way = sys.argv[1:]
print(anon(), flush=True)
if way == "load_quantized":
    model = ds_fpquant.load_quantized(path, fp_quantization={"fmt": "mxfp4"})
else:
    kwargs = {"quantization_config": DsFpQuantConfig(fmt="mxfp4")} if way == "quantize" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kwargs)
print(sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]))
"""


def _sampler():
    spec = importlib.util.spec_from_file_location("checkpoint_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._run_sampled


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=1024, intermediate_size=4096,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=128,
                                      max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():  # the values do not matter here, only the bytes
        for p in model.parameters():
            p.fill_(0.02)
    model.save_pretrained(root / "src")
    quantize_checkpoint(root / "src", root / "q", fmt="mxfp4", progress=False)
    linears = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "layers." in n}
    return dict(src=root / "src", q=root / "q", fp_weights=sum(p.numel() * 2 for p in linears.values()))


def _peak_above_imports(path, fmt):
    run = _sampler()([sys.executable, "-c", CHILD, str(path), fmt])
    after_imports, model_bytes = (int(v) for v in run["stdout"].split() if v.isdigit())
    return run["RssAnon"] - after_imports, model_bytes


@pytest.fixture(scope="module")
def plain_overhead(big):
    """Anonymous memory that transformers' own ``from_pretrained`` of the full-precision checkpoint adds."""
    return _peak_above_imports(big["src"], "plain")[0]


def test_quantized_checkpoint_loads_without_a_full_precision_copy(big, plain_overhead):
    peak, _ = _peak_above_imports(big["q"], "plain")
    print(f"peak {peak / MIB:.0f} MiB above imports; transformers' loader {plain_overhead / MIB:.0f} MiB, checkpoint "
          f"{_bytes(big['q']) / MIB:.0f} MiB, full-precision weights {big['fp_weights'] / MIB:.0f} MiB")
    assert peak <= plain_overhead + _bytes(big["q"])
    assert peak < big["fp_weights"]


def test_quantize_while_loading_as_load_quantized(big, plain_overhead):
    peak, _ = _peak_above_imports(big["src"], "quantize")
    reference, _ = _peak_above_imports(big["src"], "load_quantized")
    print(f"peak {peak / MIB:.0f} MiB above imports; load_quantized {reference / MIB:.0f} MiB, transformers' loader "
          f"{plain_overhead / MIB:.0f} MiB")
    assert peak <= reference + plain_overhead
