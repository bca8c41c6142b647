"""``ds-fpquant bench --generate``: end-to-end greedy decoding of a random Llama model, all rows in one run.

A random Llama-architecture model (transformers ``LlamaConfig``, no download; by default about 1.1 B
parameters: hidden 2048, 16 layers, intermediate 8192, 32 heads with 8 key/value heads, vocab 32000, untied
``lm_head``) is built in bf16 from a fixed seed once; each row converts and times a copy of it, freed before the
next row's copy is made (a fingerprint of the weights is compared with the build's). Rows:

* ``bf16``: the model as built;
* a ds_fpquant format or preset (``e4m3``, ``e2m1``, ``nvfp4``, or ``e4m3/128x128``): ``ds_fpquant.apply`` with
  ``{"fp_quantization": {"fmt": ...}}``, its defaults otherwise (G=128 or the preset's; every ``nn.Linear``
  except ``lm_head`` and the embeddings, ``ds_fpquant.config.DEFAULT_EXCLUDE``);
* ``int8pack`` / ``int4pack``: the same linears replaced by :class:`.peers.PeerLinear` (torch's
  ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``, what torchao's weight-only configs run on the CPU);
* ``torchao-int8``: torchao's own ``Int8WeightOnlyConfig`` through ``quantize_`` on the same linears, if
  torchao is importable (skipped otherwise, and said so).

Each row runs ``generate`` greedily (``do_sample=False``, ``min_new_tokens = max_new_tokens``, so every model
makes the same number of tokens) on the same random prompts, at each batch size, after a 2-token warm-up on the
first tokens of the prompts: the median wall time of the whole generation, and within the same generations the
time to the first token (the prompt pass) and of the decode steps after it (a stopping criterion that never
stops takes the time of each new token), from which the decode rate follows. The prefill rate is timed on its
own after the generations: one forward of the model over the prompts (``batch x prefill_tokens`` tokens, the
first ``prefill_tokens`` of each prompt; by default the whole prompt), with the KV cache built as ``generate``
builds it and the logits of the last position only, the median of ``repeat`` forwards.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import re
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ds_fpquant.cli.bench import peers
from ds_fpquant.cli.common import parse_scheme, ratio_text
from ds_fpquant.tensor.quantize import quantize

MIB = 2**20

#: About 1.1 B parameters (Llama 3.2 1B's layer shapes with a 32000-token vocabulary and an untied lm_head).
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000)

#: ``--quick``: a model for a smoke run (seconds).
LLAMA_TINY = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)

DEFAULT_ROWS = ("bf16", "e4m3", "e2m1", "nvfp4", "int8pack", "int4pack", "torchao-int8")

DEFAULT_BATCHES = (1, 8)

QUICK_BATCHES = (1, 2)

DEFAULT_PROMPT = 32

DEFAULT_NEW = 32

QUICK_TOKENS = 4

#: Timed generations per case when ``--repeat`` is not given (each gives the prompt pass and the decode rate too).
DEFAULT_REPEAT = 2

#: Prompt tokens of the warm-up generation (2 new tokens): the kernels run once, without a full prompt pass.
WARMUP_PROMPT = 4

#: Rows that are not ds_fpquant formats.
OTHER_ROWS = ("bf16", "int8pack", "int4pack", "torchao-int8")

SEED = 0


@dataclass
class GenerateResult:
    #: "bf16" | "ds_fpquant e4m3 g128" | "torch int8pack" | "torch int4pack g128" | "torchao 0.18.0 int8 weight-only"
    row: str
    fmt: str  # the --generate-formats name of the row
    batch: int
    prompt_tokens: int
    new_tokens: int
    model_mib: float  # every parameter and buffer of the model (embeddings and lm_head in bf16)
    linear_mib: float  # the linears that rows other than bf16 convert: their stored weights (+ scales, zeros)
    converted_linears: int  # how many linears the row converted (0 for bf16)
    convert_s: float  # seconds to convert the model (quantize its linears)
    generate_s: float  # median seconds of generate(new_tokens)
    prefill_s: float  # median seconds from the call to the first new token (the prompt pass), same generations
    tokens_per_s: float  # batch * new_tokens / generate_s
    decode_tokens_per_s: Optional[float]  # batch * (new_tokens - 1) / median seconds from the first to the last token
    vs_bf16: Optional[float] = None  # tokens_per_s / bf16's at the same batch
    decode_vs_bf16: Optional[float] = None
    prefill_tokens: int = 0  # prompt tokens per sequence of the timed prefill forward
    prefill_forward_s: Optional[float] = None  # median seconds of one forward over batch x prefill_tokens tokens
    prefill_tokens_per_s: Optional[float] = None  # batch * prefill_tokens / prefill_forward_s
    prefill_vs_bf16: Optional[float] = None


def llama_config(spec: Dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(**spec, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_model(spec: Dict[str, int], seed: int = SEED) -> torch.nn.Module:
    """A random bf16 ``LlamaForCausalLM`` of ``spec``, the same weights for the same seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama_config(spec), dtype=torch.bfloat16).eval()


def fingerprint(model: torch.nn.Module) -> Tuple[float, ...]:
    """Sums of a few of the model's weights (read before any conversion): equal for equal builds."""
    layer = model.model.layers[0]
    tensors = (model.model.embed_tokens.weight, layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight,
               model.model.layers[-1].mlp.up_proj.weight, model.lm_head.weight)
    return tuple(float(t.detach().double().sum()) for t in tensors)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a wrapper tensor subclass (torchao's) counts the tensors it flattens to."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def target_linears(model: torch.nn.Module) -> List[str]:
    """Names of the ``nn.Linear`` modules every converted row converts: all but ds_fpquant's default exclusions
    (``lm_head``, embeddings, other output heads)."""
    from ds_fpquant.config import DEFAULT_EXCLUDE

    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(re.search(p, name) for p in DEFAULT_EXCLUDE)]


def convert(model: torch.nn.Module, row: str, names: Sequence[str]) -> str:
    """Convert ``model`` in place for ``row``; returns the row's label. ``names``: :func:`target_linears`."""
    if row == "bf16":
        return "bf16"
    if row in ("int8pack", "int4pack"):
        for name in names:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, child, peers.PeerLinear(getattr(owner, child), row))
        return "torch int8pack" if row == "int8pack" else f"torch int4pack g{peers.INT4_GROUP}"
    if row == "torchao-int8":
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        wanted = set(names)
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn in wanted)
        return f"torchao {torchao.__version__} int8 weight-only"
    from ds_fpquant.integration.inference import apply
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    fmt, block = parse_scheme(row)
    section = {"fmt": fmt} if block is None else {"fmt": fmt, "block": list(block)}
    apply(model, {"fp_quantization": section})
    first = next(m for m in model.modules() if isinstance(m, FPQuantizedLinear))
    scaling = f"{first.block[0]}x{first.block[1]}" if first.block else f"g{first.group_size}"
    return f"ds_fpquant {first.fmt} {scaling}"


def unavailable(row: str, spec: Dict[str, int]) -> Optional[str]:
    """Why ``row`` cannot run here (``None``: it can)."""
    if row == "torchao-int8":
        try:
            import torchao.quantization  # noqa: F401
        except Exception as exc:  # torchao missing, or built for another torch
            return f"torchao is not importable ({type(exc).__name__}: {exc})"
    if row == "int4pack":
        h, i = spec["hidden_size"], spec["intermediate_size"]
        kv = spec["num_key_value_heads"] * (h // spec["num_attention_heads"])
        if h % peers.INT4_GROUP or i % peers.INT4_GROUP or kv % 16:
            return (f"int4pack needs hidden and intermediate sizes that are multiples of {peers.INT4_GROUP} and "
                    "key/value projections of a multiple of 16 outputs")
    return None


class _TokenTimes:
    """A stopping criterion that never stops: ``times`` gets ``time.perf_counter()`` each time ``generate`` has made
    a token (the first after the prompt pass)."""

    def __init__(self):
        self.times: List[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def time_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeat: int,
                  label: str) -> Tuple[float, float, Optional[float]]:
    """``(generate_s, prefill_s, decode_s)``: medians over ``repeat`` greedy ``new_tokens``-token generations of
    ``ids`` (after a 2-token warm-up on the first :data:`WARMUP_PROMPT` tokens) of the whole call, of the time to
    its first token, and of the time from the first token to the last (``None`` for one new token).

    Raises:
        RuntimeError: an output is not ``ids`` plus exactly the asked number of tokens, or generate did not
            report each token.
    """
    from transformers import GenerationConfig, StoppingCriteriaList

    def generate(prompt, n):
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                  eos_token_id=2, bos_token_id=1)
        clock = _TokenTimes()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        total = time.perf_counter() - t0
        if out.shape != (prompt.shape[0], prompt.shape[1] + n) or not torch.equal(out[:, :prompt.shape[1]], prompt):
            raise RuntimeError(f"bench --generate: {label} made {tuple(out.shape)} from a prompt of "
                               f"{tuple(prompt.shape)} and {n} new tokens")
        if len(clock.times) != n:
            raise RuntimeError(f"bench --generate: {label}: generate reported {len(clock.times)} of {n} tokens")
        return total, clock.times[0] - t0, (clock.times[-1] - clock.times[0]) if n > 1 else None

    generate(ids[:, :WARMUP_PROMPT], min(2, new_tokens))  # warm-up
    runs = [generate(ids, new_tokens) for _ in range(repeat)]
    decode = None if new_tokens == 1 else statistics.median(r[2] for r in runs)
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), decode


def time_prefill(model: torch.nn.Module, ids: torch.Tensor, repeat: int, label: str) -> float:
    """Median seconds of ``repeat`` forwards of ``model`` over ``ids`` (``(batch, tokens)``) as ``generate``'s prompt
    pass runs it: the KV cache built, the logits of the last position only (``logits_to_keep=1`` where the model
    takes it).

    Raises:
        RuntimeError: the logits are not ``(batch, 1, vocab)`` (or ``(batch, tokens, vocab)``).
    """
    kwargs = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    times = []
    with torch.no_grad():
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
            times.append(time.perf_counter() - t0)
            if out.logits.shape[0] != ids.shape[0] or out.logits.shape[1] not in (1, ids.shape[1]):
                raise RuntimeError(f"bench --generate: {label}: the prefill forward of {tuple(ids.shape)} gave logits "
                                   f"of {tuple(out.logits.shape)}")
            out = None
    return statistics.median(times)


def run(rows: Sequence[str], spec: Dict[str, int] = LLAMA_1B, batches: Sequence[int] = DEFAULT_BATCHES,
        prompt_tokens: int = DEFAULT_PROMPT, new_tokens: int = DEFAULT_NEW, repeat: int = DEFAULT_REPEAT,
        progress: bool = True, prefill_tokens: Optional[int] = None) -> Tuple[List[GenerateResult], Dict[str, str], dict]:
    """Returns ``(results, skipped, model_info)``: the rows, batch after batch; ``{row: why}`` for the rows that
    could not run; the model's size. ``prefill_tokens``: prompt tokens per sequence of the timed prefill forward
    (default ``prompt_tokens``).

    Raises:
        RuntimeError: a row's copy of the model differs from the build, or a generation is not
            ``prompt_tokens + new_tokens`` long.
    """
    prefill_tokens = prompt_tokens if prefill_tokens is None else prefill_tokens
    gen = torch.Generator().manual_seed(SEED + 1)
    prompts = torch.randint(3, spec["vocab_size"], (max(batches), max(prompt_tokens, prefill_tokens)), generator=gen)
    skipped: Dict[str, str] = {}
    results: List[GenerateResult] = []
    for row in rows:
        why = unavailable(row, spec)
        if why:
            skipped[row] = why
            if progress:
                print(f"bench --generate: {row}: skipped: {why}", flush=True)
    t0 = time.perf_counter()
    base = build_model(spec)
    reference = fingerprint(base)
    names = target_linears(base)
    info = {"parameters": sum(p.numel() for p in base.parameters()), "bf16_mib": round(module_bytes(base) / MIB, 2),
            "linears_converted": len(names),
            "linear_parameters": sum(base.get_submodule(n).weight.numel() for n in names),
            "build_s": round(time.perf_counter() - t0, 1)}
    for row in rows:
        if row in skipped:
            continue
        model = copy.deepcopy(base)
        if fingerprint(model) != reference:
            raise RuntimeError(f"bench --generate: the copy of the model made for {row} differs from the build")
        t0 = time.perf_counter()
        label = convert(model, row, names)
        convert_s = time.perf_counter() - t0
        model_mib = module_bytes(model) / MIB
        linear_mib = sum(module_bytes(model.get_submodule(n)) for n in names) / MIB
        if progress:
            print(f"bench --generate: {label}: converted in {convert_s:.1f} s, {model_mib:.0f} MiB", flush=True)
        for b in batches:
            generate_s, prefill_s, decode_s = time_generate(model, prompts[:b, :prompt_tokens], new_tokens, repeat,
                                                            label)
            decode = b * (new_tokens - 1) / decode_s if decode_s else None
            forward_s = time_prefill(model, prompts[:b, :prefill_tokens], repeat, label)
            results.append(GenerateResult(label, row, b, prompt_tokens, new_tokens, round(model_mib, 2),
                                          round(linear_mib, 2), 0 if row == "bf16" else len(names), convert_s,
                                          generate_s, prefill_s, b * new_tokens / generate_s, decode,
                                          prefill_tokens=prefill_tokens, prefill_forward_s=forward_s,
                                          prefill_tokens_per_s=b * prefill_tokens / forward_s))
            if progress:
                print(f"bench --generate: {label}, batch {b}: generate {generate_s:.2f} s, prefill forward "
                      f"{forward_s:.2f} s", flush=True)
        del model
        gc.collect()
    del base
    gc.collect()
    for r in results:
        base = next((x for x in results if x.fmt == "bf16" and x.batch == r.batch), None)
        if base is not None:
            r.vs_bf16 = r.tokens_per_s / base.tokens_per_s
            if r.decode_tokens_per_s and base.decode_tokens_per_s:
                r.decode_vs_bf16 = r.decode_tokens_per_s / base.decode_tokens_per_s
            if r.prefill_tokens_per_s and base.prefill_tokens_per_s:
                r.prefill_vs_bf16 = r.prefill_tokens_per_s / base.prefill_tokens_per_s
    results.sort(key=lambda r: r.batch)  # stable: the rows in their order within each batch
    return results, skipped, info


def format_table(results: Sequence[GenerateResult]) -> str:
    """One line per row and batch: the whole generation, its time to the first token, the prefill forward's rate
    and the decode rate, each rate with its ratio to bf16 at the same batch."""
    lines = ["| batch | model | model MiB | linear weights MiB | generate s | tokens/s | vs bf16 | first token s | "
             "prefill tokens/s | vs bf16 | decode tokens/s | vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        decode = "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.2f}"
        prefill = "-" if r.prefill_tokens_per_s is None else f"{r.prefill_tokens_per_s:.1f}"
        lines.append(f"| {r.batch} | {r.row} | {r.model_mib:.1f} | {r.linear_mib:.1f} | {r.generate_s:.3f} | "
                     f"{r.tokens_per_s:.2f} | {ratio_text(r.vs_bf16)} | {r.prefill_s:.3f} | {prefill} | "
                     f"{ratio_text(r.prefill_vs_bf16)} | {decode} | {ratio_text(r.decode_vs_bf16)} |")
    return "\n".join(lines)


def describe(spec: Dict[str, int], info: dict, prompt_tokens: int, new_tokens: int,
             prefill_tokens: Optional[int] = None) -> str:
    prefill_tokens = prompt_tokens if prefill_tokens is None else prefill_tokens
    return (f"Llama (random, bf16): hidden {spec['hidden_size']}, {spec['num_hidden_layers']} layers, intermediate "
            f"{spec['intermediate_size']}, {spec['num_attention_heads']} heads ({spec['num_key_value_heads']} kv), "
            f"vocab {spec['vocab_size']}: {info.get('parameters', 0) / 1e9:.3f} B parameters, "
            f"{info.get('bf16_mib', 0):.0f} MiB in bf16; {info.get('linears_converted', 0)} linears converted "
            f"({info.get('linear_parameters', 0) / 1e9:.3f} B parameters: all but lm_head; embeddings stay bf16); "
            f"greedy, {prompt_tokens}-token prompts, {new_tokens} new tokens; prefill tokens/s: one forward over "
            f"batch x {prefill_tokens} prompt tokens, timed apart from the generations")


SPEC_OPTIONS = (("hidden_size", "--hidden-size"), ("num_hidden_layers", "--layers"),
                ("intermediate_size", "--intermediate-size"), ("num_attention_heads", "--heads"),
                ("num_key_value_heads", "--kv-heads"), ("vocab_size", "--vocab-size"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--generate (end-to-end greedy decoding of a random Llama model)")
    group.add_argument("--generate", action="store_true", help="benchmark end-to-end generation instead")
    group.add_argument("--generate-formats", nargs="+", metavar="ROW",
                       help=f"rows: bf16, ds_fpquant formats or presets (e.g. e4m3, e4m3/128x128), int8pack, int4pack, "
                            f"torchao-int8 (default {' '.join(DEFAULT_ROWS)})")
    group.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="batch sizes (default 1 8)")
    group.add_argument("--prompt-tokens", type=int, help=f"prompt length (default {DEFAULT_PROMPT})")
    group.add_argument("--new-tokens", type=int, help=f"tokens generated (default {DEFAULT_NEW})")
    group.add_argument("--prefill-tokens", type=int, help="prompt tokens per sequence of the timed prefill forward "
                       "(default: --prompt-tokens)")
    for key, flag in SPEC_OPTIONS:
        group.add_argument(flag, type=int, dest=f"llama_{key}",
                           help=f"Llama {key} (default {LLAMA_1B[key]}; --quick {LLAMA_TINY[key]})")


def main(args, parser: argparse.ArgumentParser) -> int:
    from ds_fpquant.cli.bench.linear import cpu_cores, cpu_name, cpu_steal_seconds, llc_bytes, load_average
    from ds_fpquant.cli.common import report

    if args.device != "cpu":
        parser.error("--generate measures the CPU ops; use --device cpu")
    spec = dict(LLAMA_TINY if args.quick else LLAMA_1B)
    for key, flag in SPEC_OPTIONS:
        value = getattr(args, f"llama_{key}")
        if value is not None:
            if value < 1:
                parser.error(f"{flag} must be >= 1, got {value}")
            spec[key] = value
    if spec["hidden_size"] % spec["num_attention_heads"] or spec["num_attention_heads"] % spec["num_key_value_heads"]:
        parser.error(f"--heads {spec['num_attention_heads']} must divide --hidden-size {spec['hidden_size']} and "
                     f"--kv-heads {spec['num_key_value_heads']} must divide --heads")
    if (spec["hidden_size"] // spec["num_attention_heads"]) % 2:
        parser.error("the head size (hidden size / heads) must be even (rotary embeddings)")
    rows = args.generate_formats or DEFAULT_ROWS
    for row in rows:
        if row in OTHER_ROWS:
            continue
        try:
            fmt, block = parse_scheme(row)
            quantize(torch.zeros(2, 2), fmt, block=block)
        except (TypeError, ValueError) as exc:
            parser.error(f"--generate-formats {row}: {exc} (or one of {', '.join(OTHER_ROWS)})")
    if len(set(rows)) != len(rows):
        parser.error(f"--generate-formats {list(rows)}: a row is named twice")
    batches = args.batch_sizes or (QUICK_BATCHES if args.quick else DEFAULT_BATCHES)
    prompt = args.prompt_tokens or (QUICK_TOKENS if args.quick else DEFAULT_PROMPT)
    new = args.new_tokens or (QUICK_TOKENS if args.quick else DEFAULT_NEW)
    prefill = prompt if args.prefill_tokens is None else args.prefill_tokens
    for flag, values in (("--batch-sizes", batches), ("--prompt-tokens", [prompt]), ("--new-tokens", [new]),
                         ("--prefill-tokens", [prefill])):
        if any(v < 1 for v in values):
            parser.error(f"{flag} {list(values)}: each must be >= 1")
    repeat = args.repeat or DEFAULT_REPEAT
    t0 = time.perf_counter()
    steal0 = cpu_steal_seconds()
    results, skipped, info = run(rows, spec, batches, prompt, new, repeat, prefill_tokens=prefill)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(), "cores": cpu_cores(),
           "llc_mib": llc_bytes() / MIB, **{f"llama_{k}": v for k, v in spec.items()}, **info,
           "prompt_tokens": prompt, "new_tokens": new, "prefill_tokens": prefill, "repeat": repeat, "run_s": round(time.perf_counter() - t0, 1),
           "steal_s": None if steal0 is None else round(cpu_steal_seconds() - steal0, 1),
           "load_average": load_average()}
    if skipped:
        env["skipped"] = skipped
    report(env, describe(spec, info, prompt, new, prefill) + "\n\n" + format_table(results), results, args.json,
           getattr(args, "results", None), f"ds-fpquant bench --generate, {cpu_name()}, {cpu_cores()} cores",
           getattr(args, "command_line", None))
    return 0
