"""Writing quantized Hugging Face checkpoints: ``ds-fpquant quantize SRC DST``
(:func:`quantize_checkpoint`, from a full-precision checkpoint) and :func:`save_quantized` (from a quantized
model, also behind its ``save_pretrained``). The layouts are :mod:`ds_fpquant.checkpoint.layouts` (a ``read`` and a ``write`` module each); the files
:mod:`ds_fpquant.checkpoint.hf_files`; :func:`ds_fpquant.load_quantized` (:mod:`ds_fpquant.checkpoint.reader`) reads both.

Source tensors are read one at a time through ``safetensors.safe_open`` and output shards are bounded by
``max_shard_bytes``, so memory does not grow with the model.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ds_fpquant.checkpoint.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    clear_output,
    copy_other_files,
    iter_tensors,
    meta_model,
    model_dir,
    new_output_dir,
    read_config,
    read_tensors,
    shard_files,
    tensor_headers,
    write_model_config,
)
from ds_fpquant.checkpoint.keys import CheckpointKeys, check_patterns
from ds_fpquant.checkpoint.layouts.compressed_tensors import write as ct_write
from ds_fpquant.checkpoint.layouts.gpt_oss import write as gpt_oss_write
from ds_fpquant.checkpoint.layouts.modelopt import write as modelopt_write
from ds_fpquant.checkpoint.layouts.native.read import FP8_METHOD, OWN_METHOD
from ds_fpquant.checkpoint.layouts.native.write import quantization_config, to_parts, whole_blocks
from ds_fpquant.nn.experts import expert_matrix, expert_matrix_shape
from ds_fpquant.nn.model_walk import fused_groups, linear_modules, shared_scale_groups
from ds_fpquant.nn.quantized_params import input_scale_of, is_weight_quantized, quantized_experts
from ds_fpquant.numerics.choices import LAYOUTS as LAYOUT_CHOICES
from ds_fpquant.numerics.formats import FORMATS, FP8_DTYPES, resolve_granularity
from ds_fpquant.tensor.quantize import check_settings, nvfp4_shared_tensor_scale, quantize
from ds_fpquant.tensor.slicing import split_rows

__all__ = ["LAYOUTS", "PartialBlocksWarning", "UnsharedTensorScaleWarning", "GlobalScaleRoundingWarning",
           "quantize_checkpoint", "save_quantized"]

DEFAULT_BLOCK = (128, 128)

#: the ``layout=`` values: block FP8, compressed-tensors, NVIDIA ModelOpt, ds_fpquant's own (docs/checkpoints.md)
LAYOUTS = LAYOUT_CHOICES  # each the quant_method it writes (tests/unit/checkpoint/test_layout_writers.py checks)

GlobalScaleRoundingWarning = ct_write.GlobalScaleRoundingWarning


class _Layout:
    """The layout one checkpoint is written in (``layout=``, ``None``: block FP8 for e4m3 / e5m2 with fp32 scales,
    else ds_fpquant's), checked against the settings (resolved, as the weights' QuantizedTensors hold them) before
    anything is written: the parts of one weight by name, ``config.json``'s ``quantization_config``, other files."""

    def __init__(self, layout: Optional[str], fmt: str, group_size, block, scale_format: str):
        from ds_fpquant.numerics import checks

        fp8 = fmt in FP8_DTYPES and scale_format == "fp32"
        if layout is None:
            layout = FP8_METHOD if fp8 else OWN_METHOD
        checks.check_choice("layout", layout, LAYOUTS)
        self.method, self.inexact, self.info = layout, [], None
        if layout == FP8_METHOD and not fp8:
            raise ValueError(f"layout={layout!r} cannot hold fmt={fmt!r} with scale_format={scale_format!r}; it holds "
                             f"e4m3 / e5m2 with fp32 scales")
        if layout == ct_write.LAYOUT:
            self.info = ct_write.check(fmt, group_size, block, scale_format)
        elif layout == modelopt_write.LAYOUT:
            self.info = modelopt_write.check(fmt, group_size, block, scale_format)

    @property
    def foreign(self) -> bool:
        """Another tool's layout (compressed-tensors, ModelOpt): ``(out, in)`` Linear weights only."""
        return self.method in (ct_write.LAYOUT, modelopt_write.LAYOUT)

    def check_conv1d(self, names: Sequence[str]) -> None:
        if names and self.foreign:
            raise ValueError(f"layout={self.method!r} stores Linear (out, in) weights; these are GPT-2 Conv1D weights "
                             f"(in, out): {list(names)} (write layout='ds_fpquant', or exclude them)")

    def check_shapes(self, shapes: Dict[str, Sequence[int]]) -> None:
        """``ValueError`` for weights (name -> ``(N, K)``) whose groups the layout's readers need whole (compressed-
        tensors' group strategies and ModelOpt's NVFP4 / MX refuse ``K`` that is not a multiple of the group)."""
        group = None
        if self.method == ct_write.LAYOUT and self.info["weights"]["strategy"] in ("group", "tensor_group"):
            group = self.info["weights"]["group_size"]
        elif self.method == modelopt_write.LAYOUT:
            group = modelopt_write.GROUPS.get(self.info)
        partial = {name: tuple(shape) for name, shape in shapes.items() if group and shape[-1] % group}
        if partial:
            raise ValueError(f"layout={self.method!r} stores groups of {group} along in_features whole; these weights' "
                             f"in_features are not a multiple of {group}: {partial} (exclude them, or write "
                             f"layout='ds_fpquant')")

    def check_static(self, static: Sequence[str], quantized: Sequence[str]) -> None:
        """``ValueError`` unless the layout can describe the static per-tensor FP8 input scales of the layers
        ``static`` (SPEC 8.3) among the ``quantized`` ones (linears and expert stacks, by name): the fp8 layout any
        (``activation_scheme: "static"``, per layer with an ``input_scale``); compressed-tensors and ModelOpt one
        scheme for all (``input_activations`` static per tensor; ModelOpt's ``FP8``, per-tensor weights); ds_fpquant's
        layout none."""
        if not static or self.method == FP8_METHOD:
            return
        fix = "load the model with activation=None for weight-only layers, or write layout='fp8'"
        if self.method == OWN_METHOD:
            raise ValueError(f"layout={self.method!r} has no static activation scales; these layers have one: "
                             f"{list(static)} ({fix})")
        if self.method == modelopt_write.LAYOUT and self.info != "FP8":
            raise ValueError(f"layout={self.method!r} {self.info} quantizes activations dynamically; these layers have "
                             f"static input scales: {list(static)} (ModelOpt's static FP8 is 'FP8': granularity='tensor'"
                             f" weights; or {fix})")
        dynamic = [name for name in quantized if name not in set(static)]
        if dynamic:
            raise ValueError(f"layout={self.method!r} describes one activation scheme for every quantized linear; these "
                             f"have static input scales and these do not: {list(static)} / {dynamic} ({fix})")

    def input_scale_part(self, scale: torch.Tensor) -> torch.Tensor:
        """``<m>.input_scale`` as the layout stores it: 0-dim fp32 (fp8, ModelOpt), ``(1,)`` (compressed-tensors)."""
        return scale.reshape(1) if self.method == ct_write.LAYOUT else scale.reshape(())

    def parts(self, qt, base: str) -> Dict[str, torch.Tensor]:
        """The tensors that store ``qt`` (the weight of ``base``) by part name."""
        if self.method == ct_write.LAYOUT:
            return ct_write.to_parts(qt, self.info, self.inexact, base)
        if self.method == modelopt_write.LAYOUT:
            return modelopt_write.to_parts(qt, self.info)
        return to_parts(qt, self.method)

    def qconfig(self, layout: Dict[str, Any], not_converted: List[str], linears, transposed: List[str],
                weight_dtype: str, static: bool = False) -> Dict[str, Any]:
        """``config.json``'s ``quantization_config`` (``not_converted``: the linears and expert parameters left in
        full precision; ``linears``: the model's linear module names, the other tools list only those)."""
        kept_linears = [name for name in not_converted if name in linears]
        if self.method == ct_write.LAYOUT:
            ct_write.warn_inexact(self.inexact, stacklevel=4)
            return ct_write.quantization_config(self.info, kept_linears, static=static)
        if self.method == modelopt_write.LAYOUT:
            return modelopt_write.quantization_config(self.info, kept_linears)
        qconfig = quantization_config(self.method, layout, not_converted, transposed, weight_dtype)
        if static:  # the fp8 layout: layers with an <m>.input_scale run static W8A8 (SPEC 8.3)
            qconfig["activation_scheme"] = "static"
        return qconfig

    def write_files(self, directory, qconfig: Dict[str, Any]) -> None:
        """The layout's files besides ``config.json`` (ModelOpt: ``hf_quant_config.json``)."""
        if self.method == modelopt_write.LAYOUT:
            content = modelopt_write.hf_quant_config(self.info, qconfig["ignore"])
            (directory / modelopt_write.HF_QUANT_CONFIG).write_text(json.dumps(content, indent=4) + "\n")


def _settings(fmt: str, block, group_size, scale_format: Optional[str], exclude: Sequence[str],
              granularity: Optional[str] = None):
    """The :class:`~ds_fpquant.config.FPQuantizationConfig` of a checkpoint run, its layout name and
    the ``quantization_config`` fields that describe the codes; ``ValueError``/``TypeError`` for bad
    arguments."""
    from ds_fpquant.config import DEFAULT_EXCLUDE, FPQuantizationConfig
    from ds_fpquant.numerics import checks

    if block is not None and group_size is not None:
        raise ValueError(f"give block={tuple(block) if isinstance(block, list) else block} or "
                         f"group_size={group_size}, not both")
    if block is not None:
        block = check_settings(fmt, block=block, scale_format=scale_format)[2]
    if group_size is not None:
        group_size = checks.check_int("group_size", group_size, 1)
    group_size, block = resolve_granularity(fmt, granularity, group_size, block)  # tensor / channel: SPEC 2
    if isinstance(exclude, (str, bytes)) or not all(isinstance(p, str) for p in exclude):
        raise TypeError(f"exclude must be a list of regular expressions (str), got {exclude!r}")
    checks.check_regexes("exclude pattern", exclude)
    fp8 = fmt in FP8_DTYPES and scale_format in (None, "fp32")
    if block is None and fmt in FORMATS:
        # the FP8 layout stores row groups as [1, G] blocks; other formats keep row grouping
        block = DEFAULT_BLOCK if group_size is None else ((1, group_size) if fp8 else None)
    if block is not None:
        group_size = None  # the blocks fix the groups
    # every other argument error, before any file is touched
    resolved_group, resolved_scales, _ = check_settings(fmt, group_size, block=block, scale_format=scale_format)
    config = FPQuantizationConfig(fmt=fmt, group_size=group_size, block=block, scale_format=scale_format,
                                  exclude=[*DEFAULT_EXCLUDE, *exclude])
    layout = {"fmt": fmt, "group_size": resolved_group, "weight_block_size": list(block) if block else None,
              "scale_format": resolved_scales}
    return config, FP8_METHOD if fp8 else OWN_METHOD, layout


class PartialBlocksWarning(UserWarning):
    """Weights kept in full precision by the ``allow_partial_blocks`` rule of :func:`quantize_checkpoint`."""


class UnsharedTensorScaleWarning(UserWarning):
    """:func:`save_quantized` writes NVFP4 layers that vLLM and SGLang fuse (q/k/v, gate/up) with different tensor
    scales (``weight_scale_2``): those engines use the largest for all of them and mis-scale the others. Models
    quantized by this version (``apply``, ``load_quantized``) share them; this comes from a model that was not
    (a checkpoint of an earlier version, layers quantized one by one)."""


def quantize_checkpoint(src, dst, fmt: str = "e4m3", *, block: Optional[Tuple[int, int]] = None,
                        group_size: Optional[int] = None, scale_format: Optional[str] = None,
                        exclude: Sequence[str] = (), backend: str = "auto", allow_partial_blocks: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True,
                        granularity: Optional[str] = None, layout: Optional[str] = None) -> Dict[str, Any]:
    """Quantize the linear weights and the expert weights of the Hugging Face model directory ``src``
    into ``dst``.

    Expert weights (MoE layers, fused ``(E, out, in)`` parameters in transformers 5) are quantized each
    expert on its own, as :func:`ds_fpquant.apply` does, and written under the checkpoint's own
    per-expert keys (``mlp.experts.{e}.gate_proj.weight`` + ``weight_scale_inv``, ...); gate and up of
    an expert are quantized together as the fused ``gate_up_proj`` row they form, then split.

    Args:
        src: directory with ``config.json`` and ``.safetensors`` weights (one file or an index).
        dst: output directory; must not exist or be empty.
        fmt: element format or preset (docs/api.md). ``"e4m3"`` / ``"e5m2"`` with fp32 scales give the
            block-FP8 layout (``quant_method: "fp8"``) by default; the rest the ``"ds_fpquant"`` layout.
        block: ``(Br, Bc)`` scale blocks; default ``(128, 128)`` for element formats unless
            ``group_size`` is given (presets bring their own groups).
        group_size: row groups of ``G`` along ``in_features`` instead of blocks.
        granularity: instead of ``block`` / ``group_size``: ``"tensor"`` (one scale per weight matrix, written as
            blocks ``[2**31 - 1, 2**31 - 1]``: a side at least the matrix side is the whole side, SPEC 2) or
            ``"channel"`` (one scale per output row: groups of ``2**31 - 1``, blocks ``[1, 2**31 - 1]`` in the
            block-FP8 layout). Experts' gate and up then get a scale each (a block of rows would span both).
        scale_format: ``"fp32"`` or ``"e8m0"`` (SPEC 3); ``None``: ``"fp32"``, or the preset's own.
        exclude: regular expressions (``re.search`` on module names) of linears to keep unquantized,
            on top of :data:`ds_fpquant.config.DEFAULT_EXCLUDE` (embeddings, output heads).
        backend: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"torch"`` (tensors are quantized on CPU, or
            on the GPU with ``"cuda"``).
        allow_partial_blocks: block-FP8 layout only. By default a weight that a loader inferring the
            block size from the scales (transformers: ``rows // scale_rows``) would misread is kept in
            full precision and listed in one warning: a side that is neither a multiple of its block
            nor within one block, and GPT-2 ``Conv1D`` weights (stored ``(in, out)``). ``True`` writes
            them too; ds_fpquant's own loader reads them exactly.
        max_shard_bytes: the largest output shard (the memory the writer holds).
        progress: show a tqdm progress bar over the tensors.
        layout: the checkpoint layout (docs/checkpoints.md), one of :data:`LAYOUTS`: ``"fp8"`` (block FP8: e4m3 /
            e5m2 with fp32 scales), ``"compressed-tensors"`` (e4m3 with fp32 scales per tensor, channel, block or
            group; ``mxfp8_e4m3``, ``mxfp4``, ``mxfp6_e2m3``, ``nvfp4``), ``"modelopt"`` (e4m3 with fp32 scales and
            ``granularity="tensor"`` / ``"channel"`` or ``block=(128, 128)``; ``mxfp8_e4m3``, ``mxfp4``, ``nvfp4``;
            plus ``hf_quant_config.json``) or ``"ds_fpquant"``
            (every format); ``None``: ``"fp8"`` for e4m3 / e5m2 with fp32 scales, else ``"ds_fpquant"``. NVFP4 in
            compressed-tensors: :class:`GlobalScaleRoundingWarning` for weights whose tensor scale no divisor
            reproduces exactly.

    Returns:
        a summary: ``quantized`` / ``copied`` tensor counts, ``bytes_before`` / ``bytes_after`` of the
        weights, ``shards`` (file names), ``skipped_files`` (other weight formats not copied),
        ``kept_partial`` (weights kept by the ``allow_partial_blocks`` rule), ``quantization_config``.

    Raises:
        ValueError, TypeError: bad arguments, a missing or already-quantized ``src``, a non-empty ``dst``; a
            ``layout`` that cannot hold ``fmt`` with these scales (naming what it holds), Conv1D weights in the
            compressed-tensors or ModelOpt layout; nothing is written then.
    """
    from tqdm.auto import tqdm

    from ds_fpquant.numerics import checks
    from ds_fpquant.numerics.choices import BACKENDS

    src = model_dir(src, "src")
    dst = new_output_dir(dst, "dst")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ValueError(f"dst={str(dst)!r} must be outside src={str(src)!r}")
    max_shard_bytes = checks.check_int("max_shard_bytes", max_shard_bytes, 1)
    allow_partial_blocks = checks.check_flag("allow_partial_blocks", allow_partial_blocks)
    checks.check_choice("backend", backend, BACKENDS)
    if backend == "cuda" and not torch.cuda.is_available():
        raise ValueError("backend='cuda' needs a CUDA device; none is available here (use 'auto' or 'cpu')")
    config, _, described = _settings(fmt, block, group_size, scale_format, exclude, granularity)
    writing = _Layout(layout, fmt, described["group_size"], described["weight_block_size"], described["scale_format"])
    method = writing.method
    hf_config = read_config(src)
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"src={str(src)!r} is already quantized: quantization_config="
                         f"{hf_config.quantization_config}")
    files = shard_files(src)
    headers = tensor_headers(files)
    meta = meta_model(hf_config)
    linears, keys = linear_modules(meta), CheckpointKeys(meta)
    keys.check_fits(headers)  # every parameter of the model there, in its shape: else nothing is written
    check_patterns(exclude, [*linears, *keys.params], "exclude patterns")
    selected = keys.plan(headers, linears, config.settings_for)
    if gpt_oss_write.writes_gpt_oss(hf_config, meta, fmt, block, group_size, scale_format):  # its own layout
        if layout is not None:
            raise ValueError(f"gpt-oss's mxfp4 experts are written in gpt-oss's own layout; layout={layout!r} "
                             f"cannot be chosen for them (give layout=None)")
        return gpt_oss_write.quantize_checkpoint(src, dst, selected.stacks, headers, keys, meta, backend,
                                                  max_shard_bytes, progress)
    plan, expert_plan, fused_plan = selected.linears, selected.experts, selected.stacks
    writing.check_conv1d([name for name in plan.values() if linears[name]])
    writing.check_shapes({**{name: headers[key][1] for key, name in plan.items()},
                          **{key: headers[key][1] for key in expert_plan},
                          **{target: expert_matrix_shape(*_owner(meta, keys, target)) for target in fused_plan.values()}})
    # a stored (E, out, in) stack is written under the per-expert keys the model is released with, if it has them
    unfused = {key: keys.unfuse(key, headers[key][1]) for key in fused_plan}
    kept_partial = []
    if method == FP8_METHOD and not allow_partial_blocks:
        # what transformers' FP8 loader (and others inferring the block as rows // scale_rows) misreads or refuses
        block = described["weight_block_size"]
        for key, name in list(plan.items()):
            if linears[name] or not whole_blocks(headers[key][1], block):
                kept_partial.append(name)
                del plan[key]
        matrices = [*((p.target, headers[k][1]) for k, p in expert_plan.items()),
                    *((t, (rows, headers[k][1][2])) for k, t in fused_plan.items() if unfused[k]
                      for _, rows in unfused[k].values()),
                    *((t, expert_matrix_shape(*_owner(meta, keys, t))) for k, t in fused_plan.items()
                      if not unfused[k])]
        partial_targets = {target for target, shape in matrices if not whole_blocks(shape, block)}
        expert_plan = {k: p for k, p in expert_plan.items() if p.target not in partial_targets}
        fused_plan = {k: t for k, t in fused_plan.items() if t not in partial_targets}
        kept_partial += sorted(partial_targets)
        if kept_partial:
            warnings.warn(f"kept in full precision, since transformers' FP8 loader would misread or refuse them (blocks "
                          f"cut by the matrix edge, or Conv1D weights; allow_partial_blocks=True / "
                          f"--allow-partial-blocks writes them for ds_fpquant's own loader): {', '.join(kept_partial)}",
                          PartialBlocksWarning, stacklevel=2)
    # linears whose weight is not in the files (tied to the embeddings) or that are excluded stay as they are
    quantized_targets = {*(p.target for p in expert_plan.values()), *fused_plan.values()}
    not_converted = [name for name in linears if name not in plan.values()]
    not_converted += [name for name in keys.params if name not in quantized_targets]
    device = "cuda" if backend == "cuda" else "cpu"

    def quantize_matrix(weight: torch.Tensor, target: str, tensor_scale=None):
        extra = {} if tensor_scale is None else {"tensor_scale": tensor_scale}
        return quantize(weight.to(device), **config.settings_for(target), backend=backend, **extra)

    # NVFP4: the linears serving engines fuse (q/k/v, gate/up) share one tensor scale (SPEC 3.4); a group's
    # weights are read together when its first one comes, and skipped when the others come
    key_of = {name: key for key, name in plan.items()}
    group_of = {key_of[name]: [key_of[n] for n in group]
                for group in shared_scale_groups(plan.values(), config.settings_for) for name in group}
    read_ahead: set = set()

    def expert_matrices(target: str, part_keys: Sequence[str], tensors: Sequence[torch.Tensor]):
        """(checkpoint base name, QuantizedTensor) of one expert's parts: quantized together as the row of the
        fused parameter they form (gate over up), as apply quantizes it, then split."""
        rows = [t.shape[0] for t in tensors]
        block_rows = (described["weight_block_size"] or (1,))[0]
        if all(n % block_rows == 0 for n in rows[:-1]):
            qts = split_rows(quantize_matrix(torch.cat(tensors), target), rows)
        else:  # a block of rows would span two parts: each part gets its own blocks
            qts = [quantize_matrix(t, target) for t in tensors]
        return [(k[:-len(".weight")], qt) for k, qt in zip(part_keys, qts)]

    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        writer = ShardWriter(dst, max_shard_bytes)
        dtypes: Counter = Counter()
        bytes_before = bytes_after = 0
        pending: Dict[Tuple[str, int], Dict[int, Tuple[str, torch.Tensor]]] = {}  # an expert's parts read so far
        for key, tensor in tqdm(iter_tensors(files, read_ahead), total=len(headers), desc="quantize", unit="tensor",
                                disable=not progress):
            sources = (tensor,)
            if key in group_of:  # all of a fused group at once, with its shared tensor scale
                others = [k for k in group_of[key] if k != key]
                read_ahead.update(others)
                tensors_of = {key: tensor, **read_tensors(files, others)}
                weights = {k: t.t() if linears[plan[k]] else t for k, t in tensors_of.items()}
                shared = nvfp4_shared_tensor_scale(list(weights.values()))
                written = [(k[:-len(".weight")], quantize_matrix(weights[k], plan[k], shared)) for k in group_of[key]]
                sources = tuple(tensors_of.values())
            elif key in plan:
                name = plan[key]
                weight = tensor.t() if linears[name] else tensor  # Conv1D (in, out) -> (out, in)
                written = [(key[:-len(".weight")], quantize_matrix(weight, name))]
            elif key in fused_plan and unfused[key]:  # a stored stack, written per expert under the released keys
                written = []
                for e in range(tensor.shape[0]):
                    names = sorted((part.part, name, rows) for name, (part, rows) in unfused[key].items()
                                   if part.expert == e)
                    pieces = torch.split(tensor[e], [rows for _, _, rows in names])
                    written += expert_matrices(fused_plan[key], [name for _, name, _ in names], pieces)
            elif key in fused_plan:  # a stored stack of a model without per-expert keys: each expert on its own
                owner = _owner(meta, keys, fused_plan[key])[0]  # (E, in, out) stacks of transposed experts: (out, in)
                qts = [quantize_matrix(expert_matrix(owner, tensor, e), fused_plan[key]) for e in range(tensor.shape[0])]
                _write_stack(writer, key, qts, writing)
                written = []
                bytes_after += sum(qt.nbytes for qt in qts)
            elif key in expert_plan:  # one expert's gate, up or down, written when all its parts are read
                part = expert_plan[key]
                parts = pending.setdefault((part.target, part.expert), {})
                parts[part.part] = (key, tensor)
                if len(parts) < part.parts:
                    continue
                del pending[(part.target, part.expert)]
                part_keys, tensors = zip(*(parts[i] for i in range(part.parts)))
                written = expert_matrices(part.target, part_keys, tensors)
            else:
                writer.add(key, tensor)
                continue
            for base, qt in written:
                _write_quantized(writer, base, qt, writing)
                bytes_after += qt.nbytes
            if key in expert_plan:
                sources = tensors
            dtypes[str(tensor.dtype).replace("torch.", "")] += len(sources)
            bytes_before += sum(t.numel() * t.element_size() for t in sources)
        if pending:
            raise ValueError(f"src={str(src)!r}: these experts lack some of their matrices (gate / up): "
                             f"{sorted(f'{target}[{e}]' for target, e in pending)}")
        shards = writer.close()
        quantized = [*plan, *expert_plan, *fused_plan]
        qconfig = writing.qconfig(described, not_converted, linears, [n for n in plan.values() if linears[n]],
                                  dtypes.most_common(1)[0][0] if dtypes else "float32")
        skipped = copy_other_files(src, dst, qconfig)
        writing.write_files(dst, qconfig)
    except BaseException:
        clear_output(dst, created)
        raise
    return {"quantized": len(quantized), "copied": len(headers) - len(quantized), "bytes_before": bytes_before,
            "bytes_after": bytes_after, "shards": shards, "skipped_files": skipped, "kept_partial": kept_partial,
            "quantization_config": qconfig}


def _owner(meta, keys: CheckpointKeys, target: str):
    """(module, parameter name) of expert parameter ``target`` in the meta model."""
    module_name, pname = keys.params[target]
    return meta.get_submodule(module_name), pname


def _shared_input_scales(model: torch.nn.Module, layers) -> Dict[str, torch.Tensor]:
    """``<m>.input_scale`` of each static W8A8 layer (0-dim fp32, on the CPU): a fused group's (q/k/v, gate/up:
    :func:`~ds_fpquant.nn.model_walk.fused_groups`) static members all get the largest of their scales, so that
    vLLM's fused layer, which takes the largest of its shards', changes nothing."""
    scales = {name: model.get_submodule(name).input_scale.detach().cpu().clone() for name in layers
              if getattr(model.get_submodule(name), "static", False)}
    for group in fused_groups(scales):
        shared = torch.stack([scales[name] for name in group]).max()
        scales.update((name, shared.clone()) for name in group)
    return scales


def _stack_input_scales(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``<module>.<param>`` -> the static per-tensor input scale (0-dim fp32, on the CPU) of each quantized expert
    stack that runs static W8A8 (SPEC 8.3): one per stack, written under each of its per-expert keys."""
    scales = {}
    for name, module in model.named_modules():
        for pname in quantized_experts(module):
            scale = input_scale_of(module, pname)
            if scale is not None:
                scales[f"{name}.{pname}" if name else pname] = scale.detach().cpu().clone()
    return scales


def _write_quantized(writer: "ShardWriter", base: str, qt, writing: _Layout) -> None:
    """Add the tensors of ``qt`` as ``<base>.weight``, ``<base>.weight_scale_inv`` / ``.weight_scale`` / ... ."""
    for part_name, part in writing.parts(qt, base).items():
        writer.add(f"{base}.{part_name}", part)


def _write_stack(writer: "ShardWriter", key: str, qts, writing: _Layout) -> None:
    """Add the experts ``qts`` of a stored stack as ``<key>`` ``(E, ...)`` plus ``<key>_scale_inv`` / ... ."""
    stacked = [writing.parts(qt, f"{key}[expert {e}]") for e, qt in enumerate(qts)]
    for part_name in stacked[0]:
        writer.add(key + part_name[len("weight"):], torch.stack([t[part_name] for t in stacked]))


def _quantized_parts(model: torch.nn.Module):
    """(name -> (QuantizedTensor, bias)) of the FPQuantizedLinear layers and (``<module>.<param>`` ->
    per-expert QuantizedTensors) of the quantized expert stacks of ``model``."""
    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    layers, stacks = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, FPQuantizedLinear):
            layers[name] = (module.quantized_weight, module.bias)
        elif is_weight_quantized(module):
            raise ValueError(f"{name} is a tensor-parallel shard quantized in place (AutoTP): save the tp=1 model, "
                             f"or quantize the original checkpoint with `ds-fpquant quantize`")
        for pname, experts in quantized_experts(module).items():
            stacks[f"{name}.{pname}" if name else pname] = experts
    return layers, stacks


def save_quantized(model: torch.nn.Module, directory, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   allow_partial_blocks: bool = True, layout: Optional[str] = None) -> Dict[str, Any]:
    """Write a quantized transformers model (from :func:`ds_fpquant.apply`, ``init_inference``'s
    ``engine.module`` at tp=1, or :func:`load_quantized`) as the checkpoint :func:`quantize_checkpoint`
    would write for it: codes and scales as they are (nothing is quantized again), expert stacks under
    the per-expert keys the model is released with, ``config.json`` with ``quantization_config``.
    ``model.save_pretrained(directory)`` of a quantized model calls this. Static W8A8 layers (an ``input_scale``,
    SPEC 8.3) add ``<m>.input_scale`` (fp32, 0-dim; a fused group's, q/k/v or gate/up, shared: the largest, so
    vLLM's max of the shards changes nothing) and ``activation_scheme: "static"``; static W8A8 expert stacks write
    their one scale as the ``input_scale`` of every per-expert matrix (``mlp.experts.{e}.gate_proj.input_scale``
    ...), so vLLM's max over the experts gives it back (a stack without per-expert keys: ``ValueError``).

    Args:
        model: a transformers ``PreTrainedModel`` with quantized layers, all with one format and scaling
            (``fmt``, ``group_size`` / ``block``, ``scale_format``: a checkpoint describes one).
        directory: output directory; must not exist or be empty.
        max_shard_bytes: the largest output shard.
        allow_partial_blocks: block-FP8 layout: weights transformers' FP8 loader would misread (see
            :func:`quantize_checkpoint`) cannot be kept in full precision here (the model no longer holds
            it); ``True`` (default) writes them with a :class:`PartialBlocksWarning`, ``False`` raises.
        layout: the checkpoint layout, as for :func:`quantize_checkpoint` (``None``: ``"fp8"`` for e4m3 / e5m2 with
            fp32 scales, else ``"ds_fpquant"``); the layers' settings must be ones it holds.

    Returns:
        the summary :func:`quantize_checkpoint` returns (``bytes_before`` is the full-precision size), plus
        ``tied``: ``{key: the key it is written under}`` for the tensors written once for two names.

    Raises:
        TypeError, ValueError: not a transformers model, no quantized layers, layers with different
            settings, AutoTP shards, a non-empty ``directory``, partial blocks with
            ``allow_partial_blocks=False``, a ``layout`` that cannot hold the layers' settings; nothing is written
            then.
    """
    from ds_fpquant.numerics import checks

    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    directory = new_output_dir(directory, "directory")
    max_shard_bytes = checks.check_int("max_shard_bytes", max_shard_bytes, 1)
    allow_partial_blocks = checks.check_flag("allow_partial_blocks", allow_partial_blocks)
    layers, stacks = _quantized_parts(model)
    if not layers and not stacks:
        raise ValueError(f"{type(model).__name__} holds no ds_fpquant-quantized layers; save it with save_pretrained")
    if layout is None and gpt_oss_write.can_save(model, layers, stacks):  # gpt-oss, mxfp4 experts: its own layout
        return gpt_oss_write.save_quantized(model, directory, max_shard_bytes=max_shard_bytes)
    qts = {**{name: qt for name, (qt, _) in layers.items()}, **{name: qts[0] for name, qts in stacks.items()}}
    settings = {name: (qt.fmt, qt.group_size, qt.block, qt.scale_format, qt.grouping) for name, qt in qts.items()}
    first = next(iter(settings.values()))
    differ = {name: s for name, s in settings.items() if s != first}
    if differ:
        raise ValueError(f"a checkpoint holds one format and scaling; these layers differ from "
                         f"{next(iter(settings))} {first} (fmt, group_size, block, scale_format, grouping): {differ}")
    fmt, group_size, block, scale_format, _ = first
    writing = _Layout(layout, fmt, group_size, block, scale_format)
    method = writing.method
    block_size = list(block) if block else ([1, group_size] if method == FP8_METHOD else None)
    meta = meta_model(config.__class__.from_dict(config.to_dict()), type(model))
    linears, keys = linear_modules(meta), CheckpointKeys(meta)
    writing.check_conv1d([n for n in layers if linears.get(n)])
    writing.check_shapes({name: qt.shape for name, qt in qts.items()})
    partial = [n for n, qt in qts.items() if method == FP8_METHOD and (linears.get(n) or not whole_blocks(qt.shape, block_size))]
    if partial and not allow_partial_blocks:
        raise ValueError(f"these quantized weights would be misread by transformers' FP8 loader (blocks cut by the "
                         f"matrix edge, or Conv1D): {partial}; pass allow_partial_blocks=True to write them anyway")
    if partial:
        warnings.warn(f"written although transformers' FP8 loader would misread or refuse them: {', '.join(partial)}",
                      PartialBlocksWarning, stacklevel=2)
    unshared = [group for group in fused_groups(layers) if all(layers[n][0].fmt == "nvfp4" for n in group)
                and len({layers[n][0].tensor_scale.item() for n in group}) > 1]
    if unshared:
        warnings.warn(f"these NVFP4 layers, which vLLM and SGLang fuse, have different tensor scales (weight_scale_2); "
                      f"those engines would use the largest for all of a group and mis-scale the others (quantize "
                      f"them again with ds_fpquant.apply or quantize_checkpoint, which share them): "
                      f"{[list(g) for g in unshared]}", UnsharedTensorScaleWarning, stacklevel=2)
    # exactly the state-dict entries written below from the quantized parts (and the layers' extra state, which
    # the checkpoint's quantization_config replaces), found by the module that holds them (a layer registered
    # under a second name is the same module); every other entry is written as it is, or tied
    layer_of = {id(model.get_submodule(name)): name for name in layers}
    layer_keys = ("weight_codes", "weight_scales", "weight_tensor_scale", "bias", "_extra_state", "input_scale")
    input_scales = _shared_input_scales(model, layers)
    stack_inputs = _stack_input_scales(model)
    writing.check_static([*input_scales, *stack_inputs], [*layers, *stacks])
    stack_of = {}
    for name in stacks:
        owner, _, pname = name.rpartition(".")
        for suffix in ("codes", "scales", "tensor_scale", "input_scale"):
            stack_of[(id(model.get_submodule(owner)), f"{pname}_{suffix}")] = f"{name}_{suffix}"

    def quantized_part(key: str) -> Optional[str]:
        """The canonical key of the quantized part that state-dict entry ``key`` is, else ``None``."""
        owner, _, leaf = key.rpartition(".")
        module = id(model.get_submodule(owner))
        if module in layer_of and leaf in layer_keys:
            return f"{layer_of[module]}.{leaf}"
        return stack_of.get((module, leaf))

    def expert_rows(names, e: int):
        """(part, checkpoint key, rows) of expert ``e``'s matrices, gate before up."""
        return sorted((part.part, key, rows) for key, (part, rows) in names.items() if part.expert == e)

    block_rows = block_size[0] if block_size else 1
    per_expert = {}  # stack -> its per-expert keys, or None: stored as a stack
    for name, experts in stacks.items():
        names = keys.unfuse(name, (len(experts), *experts[0].shape))
        ok = names and all(rows % block_rows == 0 for _, _, rows in expert_rows(names, 0)[:-1])
        per_expert[name] = names if ok else None
    whole = [name for name in stack_inputs if per_expert[name] is None]
    if whole:
        raise ValueError(f"these static W8A8 expert stacks (an input_scale) would be stored as whole (E, ...) stacks, "
                         f"which no layout gives an input_scale: {whole} (they have no per-expert keys, or a block of "
                         f"rows spans gate and up); load the model with activation=None for weight-only experts")

    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        writer, seen, copied, tied = ShardWriter(directory, max_shard_bytes), {}, 0, {}
        bytes_before = bytes_after = 0
        for key, tensor in model.state_dict(keep_vars=True).items():
            canonical = quantized_part(key)
            if canonical is not None:
                if canonical != key and not key.endswith("._extra_state"):
                    tied[key] = canonical  # the same layer under a second name
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{key}: the state dict holds a {type(tensor).__name__}, not a tensor; nothing written")
            if tensor.numel() and tensor.data_ptr() in seen:  # a tied weight: the loader ties it again (listed)
                tied[key] = seen[tensor.data_ptr()]
                continue
            seen[tensor.data_ptr()] = key
            writer.add(key, tensor.detach().cpu())
            copied += 1
        for name, (qt, bias) in layers.items():
            _write_quantized(writer, name, qt, writing)
            if name in input_scales:
                writer.add(f"{name}.input_scale", writing.input_scale_part(input_scales[name]))
            if bias is not None:
                writer.add(f"{name}.bias", bias.detach().cpu())
            bytes_before += math.prod(qt.shape) * qt.dtype.itemsize
            bytes_after += qt.nbytes
        for name, experts in stacks.items():
            shape = (len(experts), *experts[0].shape)
            names = per_expert[name]
            if names:
                for e, qt in enumerate(experts):
                    parts = expert_rows(names, e)
                    for (_, key, _), piece in zip(parts, split_rows(qt, [rows for _, _, rows in parts])):
                        _write_quantized(writer, key[:-len(".weight")], piece, writing)
                        if name in stack_inputs:  # the stack's one scale under each expert matrix's key
                            writer.add(key[:-len(".weight")] + ".input_scale",
                                       writing.input_scale_part(stack_inputs[name]).clone())
            else:  # no per-expert keys for this model, or a block of rows spans gate and up: stored as a stack
                _write_stack(writer, name, experts, writing)
            bytes_before += math.prod(shape) * experts[0].dtype.itemsize
            bytes_after += sum(qt.nbytes for qt in experts)
        shards = writer.close()
        described = {"fmt": fmt, "group_size": group_size, "weight_block_size": block_size,
                     "scale_format": scale_format}
        not_converted = [n for n in linears if n not in layers] + [n for n in keys.params if n not in stacks]
        qconfig = writing.qconfig(described, not_converted, linears, [n for n in layers if linears.get(n)],
                                  str(next(iter(qts.values())).dtype).replace("torch.", ""),
                                  static=bool(input_scales or stack_inputs))
        write_model_config(directory, model, qconfig)
        writing.write_files(directory, qconfig)
    except BaseException:
        clear_output(directory, created)
        raise
    return {"quantized": len(qts), "copied": copied, "tied": tied, "bytes_before": bytes_before,
            "bytes_after": bytes_after, "shards": shards, "skipped_files": [], "kept_partial": [],
            "quantization_config": qconfig}
