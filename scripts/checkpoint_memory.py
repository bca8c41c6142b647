"""Peak memory of ``ds-fpquant quantize`` on a random model saved in shards (docs/checkpoints.md, "Memory"),
or with ``--load`` of quantizing while loading (``load_quantized(SRC, fp_quantization=...)``) against
``from_pretrained`` + ``apply``, each in its own child process.

Builds a random GPT-2 or Mixtral (MoE) model whose fp32 weights are about ``--mb`` MB, saves it with
``save_pretrained`` in shards, runs the command in a child process and samples its ``/proc/<pid>/status``
every 20 ms: ``RssAnon`` (memory the process owns) and ``RssFile`` (memory-mapped input pages, which the
kernel can drop). Prints the peak anonymous memory next to the process's memory after its imports and
the largest source tensor, the output shard limit and the largest expert (gate + up) it may hold.

    python scripts/checkpoint_memory.py --model mixtral --mb 1200 --max-shard-size 64
    python scripts/checkpoint_memory.py --model gpt2 --mb 1200 --load
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _build(kind: str, mb: int, path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        layers = max(1, round(mb * 2**20 / 4 / (12 * 1024 * 1024)))
        config = transformers.GPT2Config(n_layer=layers, n_embd=1024, n_head=16, vocab_size=1000, n_positions=128)
        cls = transformers.GPT2LMHeadModel
    else:
        per_layer = 8 * 3 * 1024 * 2816 + 4 * 1024 * 1024
        layers = max(1, round(mb * 2**20 / 4 / per_layer))
        config = transformers.MixtralConfig(hidden_size=1024, intermediate_size=2816, num_local_experts=8,
                                            num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=16,
                                            num_key_value_heads=16, vocab_size=1000, max_position_embeddings=128)
        cls = transformers.MixtralForCausalLM
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="400MB")


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _run_sampled(cmd) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "RssFile": 0}
    start = time.perf_counter()
    while proc.poll() is None:
        try:
            now = _status(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        for key in peak:
            peak[key] = max(peak[key], now.get(key, 0))
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{err}")
    return {**peak, "seconds": time.perf_counter() - start, "stdout": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "mixtral"], default="mixtral")
    parser.add_argument("--mb", type=int, default=1200, help="fp32 weights of the random model, MB")
    parser.add_argument("--max-shard-size", type=int, default=64, help="output shard limit, MiB")
    parser.add_argument("--fmt", default="e4m3")
    parser.add_argument("--load", action="store_true", help="measure quantize-while-loading against "
                        "from_pretrained + apply instead of the quantize command")
    args = parser.parse_args()
    import torch
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        _build(args.model, args.mb, src)
        sizes = {}
        for f in src.glob("*.safetensors"):
            with safe_open(f, "pt") as fh:
                for k in fh.keys():
                    s = fh.get_slice(k)
                    sizes[k] = torch.Size(s.get_shape()).numel() * 4
        imports = _run_sampled([sys.executable, "-c", "import torch, transformers, safetensors, ds_fpquant.checkpoint.writer, "
                                "ds_fpquant.tensor.quantize; ds_fpquant.tensor.quantize.quantize(torch.zeros(2, 2), 'e4m3')"])
        if args.load:
            _compare_loads(src, args.fmt, sizes, imports)
            return
        run = _run_sampled([sys.executable, "-m", "ds_fpquant", "quantize", str(src), str(dst), "--fmt", args.fmt,
                            "--max-shard-size", str(args.max_shard_size), "--no-progress", "--allow-partial-blocks"])
        largest = max(sizes.values())
        expert = max((v for k, v in sizes.items() if ".experts." in k), default=0)
        result = {"model": args.model, "fp32_weights_MB": round(sum(sizes.values()) / 1e6),
                  "tensors": len(sizes), "largest_tensor_MB": round(largest / 1e6, 1),
                  "gate_plus_up_MB": round(2 * expert / 1e6, 1), "shard_limit_MB": round(args.max_shard_size * 2**20 / 1e6),
                  "after_imports_anon_MB": round(imports["RssAnon"] / 1e6),
                  "peak_anon_MB": round(run["RssAnon"] / 1e6), "peak_file_MB": round(run["RssFile"] / 1e6),
                  "seconds": round(run["seconds"], 1)}
        result["anon_above_imports_MB"] = result["peak_anon_MB"] - result["after_imports_anon_MB"]
        print(run["stdout"].strip().splitlines()[0])
        print(json.dumps(result, indent=1))


LOAD = """
import sys, torch, transformers, ds_fpquant as fpq
src, fmt, way = sys.argv[1:]
section = {"fmt": fmt, "block": [128, 128]}
if way == "load_quantized":
    model = fpq.load_quantized(src, fp_quantization=section)
else:
    model = fpq.apply(transformers.AutoModelForCausalLM.from_pretrained(src), {"fp_quantization": section})
print(sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]))
"""


def _compare_loads(src: Path, fmt: str, sizes: dict, imports: dict) -> None:
    runs = {way: _run_sampled([sys.executable, "-c", LOAD, str(src), fmt, way])
            for way in ("load_quantized", "from_pretrained + apply")}
    model_bytes = int(runs["load_quantized"]["stdout"].strip().splitlines()[-1])
    print("| way | peak anonymous MB | above imports MB | peak mapped input MB | s |")
    print("|---|---|---|---|---|")
    for way, run in runs.items():
        print(f"| {way} | {run['RssAnon'] / 1e6:.0f} | {(run['RssAnon'] - imports['RssAnon']) / 1e6:.0f} | "
              f"{run['RssFile'] / 1e6:.0f} | {run['seconds']:.1f} |")
    print(f"fp32 weights {sum(sizes.values()) / 1e6:.0f} MB, quantized model (parameters + buffers) "
          f"{model_bytes / 1e6:.0f} MB, largest tensor {max(sizes.values()) / 1e6:.1f} MB, after imports "
          f"{imports['RssAnon'] / 1e6:.0f} MB")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
