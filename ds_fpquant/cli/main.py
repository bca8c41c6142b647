"""``ds-fpquant`` command line (docs/api.md): ``demo`` (the main job), ``bench``, ``report`` and ``quantize``."""

from __future__ import annotations

import argparse
import os
import sys

from ds_fpquant.cli.quantize import quantize_main

COMMANDS = {
    "demo": "quantize all-MiniLM-L6-v2's linear weights in every format, run it under DeepSpeed "
            "inference and print an accuracy table",
    "bench": "quantize/dequantize throughput (--linear: the quantized linear layer; --generate: end-to-end decoding "
             "of a random Llama) with ratios against baselines measured in the same run",
    "report": "DeepSpeed's op report with the ds_fpquant ops added (--build: build and self-test them)",
    "quantize": "quantize a Hugging Face checkpoint (SRC DST) into an FP8/FP6/FP4 checkpoint",
}


def _quiet_accelerator_detection() -> None:
    """Name DeepSpeed's accelerator up front when there is no GPU, so its detection warning
    ("Setting accelerator to CPU") does not land in the middle of the command's table on stdout."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ds-fpquant", description="FP8/FP6/FP4 group quantization for DeepSpeed")
    parser.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    args, _ = parser.parse_known_args(argv[:1])
    _quiet_accelerator_detection()
    if args.command == "demo":
        from ds_fpquant.cli import demo
        return demo.main(argv[1:])
    if args.command == "bench":
        from ds_fpquant.cli.bench import ops as bench
        return bench.main(argv[1:])
    if args.command == "report":
        from ds_fpquant.cli import report
        return report.main(argv[1:])
    if args.command == "quantize":
        return quantize_main(argv[1:])
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
