"""``torch.compile(fullgraph=True)`` against eager for a quantized model (issue 16), in one run.

A random Llama (hidden 1024, 8 layers: about 420 MB of fp32 linear weights, more than the last-level
cache) quantized with ``ds_fpquant.apply`` (e4m3, groups of 128). Times the forward of one token (decode,
no cache) and of 64 tokens (prefill), eager and compiled (inductor, ``fullgraph=True``) timed in turn, and
the same for the unquantized model; prints medians and the compiled/eager ratios.

    OMP_NUM_THREADS=2 python benchmarks/compile_vs_eager.py
"""

import argparse
import copy
import statistics
import time

import torch
import transformers

import ds_fpquant as fpq


def _median_seconds(fns, repeats: int):
    """Median seconds of each of ``fns``, timed in turn within each repeat (so that the machine's load drifts
    over all of them alike), after one warm-up call each (which compiles)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fmt", default="e4m3")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                                      num_attention_heads=16, num_key_value_heads=16, vocab_size=1000,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    quantized = fpq.apply(copy.deepcopy(model), {"fp_quantization": {"fmt": args.fmt, "group_size": 128}})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Llama hidden 1024, {args.layers} layers, "
          f"{args.fmt} groups of 128")
    print("| model | tokens | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for name, m in (("quantized", quantized), ("fp32", model)):
            torch._dynamo.reset()
            compiled = torch.compile(m, fullgraph=True)
            for tokens in (1, 64):
                ids = torch.randint(0, 1000, (1, tokens))
                eager, fast = _median_seconds([lambda: m(ids, use_cache=False), lambda: compiled(ids, use_cache=False)],
                                              args.repeats)
                print(f"| {name} | {tokens} | {eager * 1e3:.1f} | {fast * 1e3:.1f} | {fast / eager:.2f} |")


if __name__ == "__main__":
    main()
