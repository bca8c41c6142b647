"""Checkpoints of tiny random models for the transformers front-door tests: the full-precision source (bf16 Llama,
fp32 Qwen3-MoE and GPT-2) and its quantized copies (``ds-fpquant quantize``), written once per session."""

import torch
from unit.moe_models import tiny_qwen3_moe
from unit.tiny_models import tiny_gpt2, tiny_llama

from ds_fpquant.checkpoint.writer import quantize_checkpoint

MODELS = {"llama": lambda: tiny_llama().to(torch.bfloat16), "qwen3_moe": tiny_qwen3_moe, "gpt2": tiny_gpt2}

#: The formats of the issue, as ``quantize_checkpoint`` / ``fp_quantization`` settings, by name. e4m3 and e4m3 in
#: 128x128 blocks are written in block FP8 (``quant_method: "fp8"``, transformers' own layout), the rest in the
#: ``"ds_fpquant"`` layout.
FORMATS = {"e4m3": {"fmt": "e4m3", "group_size": 32}, "e2m1": {"fmt": "e2m1", "group_size": 32},
           "mxfp4": {"fmt": "mxfp4"}, "nvfp4": {"fmt": "nvfp4"}, "e4m3_128x128": {"fmt": "e4m3", "block": [128, 128]}}

#: Formats written in block FP8, which transformers owns.
FP8_LAYOUT = ("e4m3", "e4m3_128x128")


class Checkpoints:
    """Source and quantized checkpoint directories under ``root``, made on first use."""

    def __init__(self, root):
        self.root = root

    def source(self, model: str):
        path = self.root / model / "src"
        if not path.is_dir():
            MODELS[model]().save_pretrained(path)
        return path

    def quantized(self, model: str, fmt: str):
        path = self.root / model / fmt
        if not path.is_dir():
            quantize_checkpoint(self.source(model), path, progress=False, allow_partial_blocks=True, **FORMATS[fmt])
        return path
