"""``ds-fpquant quantize SRC DST``: the command-line front of :func:`ds_fpquant.quantize_checkpoint`."""

from __future__ import annotations

import argparse


def quantize_parser():
    """The argument parser of ``ds-fpquant quantize``; its choices come from :mod:`ds_fpquant.numerics.choices`."""
    from ds_fpquant.checkpoint.hf_files import DEFAULT_MAX_SHARD_BYTES
    from ds_fpquant.checkpoint.writer import LAYOUTS
    from ds_fpquant.numerics.choices import ALL_SCALE_FORMATS, BACKENDS, GRANULARITIES
    from ds_fpquant.numerics.formats import FORMATS, PRESETS

    parser = argparse.ArgumentParser(
        prog="ds-fpquant quantize",
        description="Quantize the linear and mixture-of-experts weights of a Hugging Face model directory "
                    "(safetensors) into an FP8/FP6/FP4 checkpoint: by default block-FP8 (quant_method 'fp8', what vLLM and "
                    "SGLang load) for e4m3/e5m2, the ds_fpquant layout otherwise; --layout picks compressed-tensors or "
                    "ModelOpt instead (docs/checkpoints.md). Load it back with ds_fpquant.load_quantized.")
    parser.add_argument("src", help="model directory with config.json and .safetensors weights")
    parser.add_argument("dst", help="output directory (new or empty)")
    parser.add_argument("--fmt", default="e4m3", choices=[*FORMATS, *PRESETS], help="element format or preset "
                        "(default e4m3)")
    scaling = parser.add_mutually_exclusive_group()
    scaling.add_argument("--block", nargs=2, type=int, metavar=("BR", "BC"),
                         help="2-D scale blocks (default 128 128 for element formats)")
    scaling.add_argument("--group-size", type=int, metavar="G", help="row groups of G along in_features instead")
    scaling.add_argument("--granularity", choices=list(GRANULARITIES),
                         help="tensor: one scale per weight matrix; channel: one per output row (instead of blocks "
                              "or groups; docs/spec.md SPEC 2)")
    parser.add_argument("--scale-format", choices=list(ALL_SCALE_FORMATS),
                        help="scale format (SPEC 3; default fp32, or the preset's own; e4m3 is nvfp4's)")
    parser.add_argument("--layout", choices=list(LAYOUTS),
                        help="checkpoint layout (default: fp8 for e4m3/e5m2 with fp32 scales, else ds_fpquant); "
                             "compressed-tensors holds e4m3 (tensor/channel/block/group), mxfp8_e4m3, mxfp4, "
                             "mxfp6_e2m3, nvfp4; modelopt holds e4m3 with --granularity tensor/channel or 128x128 "
                             "blocks, mxfp8_e4m3, mxfp4, nvfp4")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="regular expression (re.search) of module names to keep unquantized; repeat for more "
                             "(embeddings and output heads are always kept)")
    parser.add_argument("--backend", default="auto", choices=list(BACKENDS),
                        help="auto: the compiled op, else the torch reference; cuda quantizes on the GPU")
    parser.add_argument("--allow-partial-blocks", action="store_true",
                        help="block-FP8 layout: also write the weights transformers' FP8 loader misreads or refuses (a "
                             "side that is not a multiple of its block and longer than one; GPT-2 Conv1D weights), "
                             "which are otherwise kept in full precision and listed; ds_fpquant's own loader reads them")
    parser.add_argument("--max-shard-size", type=int, default=DEFAULT_MAX_SHARD_BYTES // 2**20, metavar="MIB",
                        help="largest output shard in MiB (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def quantize_main(argv=None) -> int:
    """``ds-fpquant quantize SRC DST [options]`` (:func:`ds_fpquant.quantize_checkpoint`)."""
    import warnings

    from ds_fpquant.checkpoint.writer import PartialBlocksWarning, quantize_checkpoint

    parser = quantize_parser()
    args = parser.parse_args(argv)
    if args.max_shard_size < 1:
        parser.error(f"--max-shard-size must be >= 1, got {args.max_shard_size}")
    try:
        with warnings.catch_warnings():  # the command prints the kept weights itself
            warnings.simplefilter("ignore", PartialBlocksWarning)
            summary = quantize_checkpoint(args.src, args.dst, args.fmt, block=tuple(args.block) if args.block else None,
                                          group_size=args.group_size, granularity=args.granularity,
                                          scale_format=args.scale_format, layout=args.layout,
                                          exclude=args.exclude, backend=args.backend,
                                          allow_partial_blocks=args.allow_partial_blocks,
                                          max_shard_bytes=args.max_shard_size * 2**20, progress=not args.no_progress)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    qc = summary["quantization_config"]
    scaling_text = (f"blocks {qc['weight_block_size'][0]}x{qc['weight_block_size'][1]}" if qc.get("weight_block_size")
                    else f"groups of {qc.get('group_size')}")
    if "weight_block_size" not in qc and "group_size" not in qc:  # another tool's layout: its own scheme name
        scaling_text = str(qc.get("format") or qc.get("quant_algo"))
    if args.granularity:
        scaling_text = f"one scale per {'matrix' if args.granularity == 'tensor' else 'output row'}"
    print(f"{args.dst}: {summary['quantized']} linear and expert weights quantized to {args.fmt} ({scaling_text}, "
          f"quant_method {qc['quant_method']!r}), {summary['copied']} tensors copied unchanged; weights "
          f"{summary['bytes_before'] / 2**20:.2f} MiB -> {summary['bytes_after'] / 2**20:.2f} MiB; "
          f"{len(summary['shards'])} shard(s)")
    kept = qc.get("modules_to_not_convert", qc.get("ignore", []))
    if kept:
        print(f"kept unquantized: {', '.join(kept)}")
    if summary["kept_partial"]:
        print(f"(of these, kept because transformers' FP8 loader would misread them; --allow-partial-blocks writes "
              f"them: {', '.join(summary['kept_partial'])})")
    for name in summary["skipped_files"]:
        print(f"not copied (weights in another format): {name}")
    return 0
