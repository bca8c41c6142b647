"""``ds-fpquant`` command line (API.md): ``demo`` (the main job)."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": "quantize all-MiniLM-L6-v2's linear weights in every format, run it under DeepSpeed "
            "inference and print an accuracy table",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ds-fpquant", description="FP8/FP6/FP4 group quantization for DeepSpeed")
    parser.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "demo":
        from . import demo
        return demo.main(argv[1:])
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
