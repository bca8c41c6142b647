"""Hugging Face checkpoints: ``ds-fpquant quantize SRC DST`` and :func:`load_quantized`.

Two layouts (``docs/checkpoints.md`` has the details):

- ``quant_method: "fp8"`` for e4m3 / e5m2 with fp32 scales: each quantized ``<m>.weight`` is a
  ``torch.float8_e4m3fn`` (or ``float8_e5m2``) tensor of the weight's shape and ``<m>.weight_scale_inv``
  holds the fp32 block scales ``(ceil(N/Br), ceil(K/Bc))`` (the multiplier: ``w = q * s``), with
  ``weight_block_size: [Br, Bc]`` in ``quantization_config``: the block-FP8 layout vLLM, SGLang and
  transformers load (DeepSeek-V3 style). Row groups of ``G`` are written as blocks ``[1, G]``.
- ``quant_method: "ds_fpquant"`` for everything else (FP6, FP4, e4m7, E8M0 / MX, NVFP4):
  ``<m>.weight`` is ``uint8`` packed codes ``(N, row_bytes)`` (SPEC 6), ``<m>.weight_scale`` the
  scales as :class:`ds_fpquant.QuantizedTensor` holds them (fp32, E8M0 bytes as ``uint8``, NVFP4 e4m3
  codes as ``float8_e4m3fn``) and, for NVFP4, ``<m>.weight_scale_2`` the fp32 per-tensor scale.

Reading and writing go tensor by tensor through ``safetensors.safe_open``; output shards are
bounded by ``max_shard_bytes``, so memory stays at one output shard plus one tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import types
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import __version__
from .api import _check_quantized, quantize
from .checkpoint_keys import CheckpointKeys, expert_parameters
from .experts import install_quantized_experts
from .slicing import join_rows, split_rows
from .formats import FORMATS, PRESETS

__all__ = ["PartialBlocksWarning", "quantize_checkpoint", "load_quantized", "save_quantized", "main"]

CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: Weight files of other formats: never copied to DST (they would hold the unquantized weights).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".ot")
FP8_METHOD, OWN_METHOD = "fp8", "ds_fpquant"
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: dtypes of ``weight_scale_inv`` in block-FP8 checkpoints: multipliers, or E8M0 exponent bytes (SPEC 3.2).
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E8M0_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
#: Suffixes of the tensors that belong to a quantized weight, in both layouts.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2")
DEFAULT_BLOCK = (128, 128)
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


# ---- reading a model directory ------------------------------------------------------------------


def _model_dir(path, name: str) -> Path:
    """``path`` as a Hugging Face model directory (with ``config.json``), or ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike directory, got {type(path).__name__}")
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ValueError(f"{name}={str(path)!r} is not a Hugging Face model directory (no {CONFIG})")
    return path


def _read_config(directory: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{str(directory / CONFIG)!r} could not be read by transformers: {exc}") from None


def _shard_files(directory: Path) -> List[Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{str(index)!r} is not a safetensors index (no valid weight_map): {exc}") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names shards that are not there: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(directory)!r} holds no .safetensors weights (found: "
                         f"{sorted(p.name for p in directory.iterdir())}); save the model with "
                         f"save_pretrained(..., safe_serialization=True) first")
    return files


def _tensor_headers(files: Sequence[Path]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Every tensor name -> its safetensors dtype (``"F32"``, ``"F8_E4M3"``, ``"U8"``, ...) and shape,
    from the file headers only."""
    from safetensors import safe_open

    headers = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():
                    piece = fh.get_slice(key)
                    headers[key] = (piece.get_dtype(), tuple(piece.get_shape()))
        except Exception as exc:  # safetensors raises its own SafetensorError for a damaged file
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {exc}") from None
    return headers


def _iter_tensors(files: Sequence[Path]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, one at a time."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                yield key, fh.get_tensor(key)


def _model_class(config, model_class=None):
    import transformers

    if model_class is not None:
        return model_class
    names = getattr(config, "architectures", None) or ()
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if names:
        raise ValueError(f"config.json names architectures={list(names)}, which this transformers "
                         f"({transformers.__version__}) does not have; pass model_class=")
    try:
        return transformers.AutoModel._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"no transformers model class for {type(config).__name__}; pass model_class=") from None


def _meta_model(config, model_class=None) -> torch.nn.Module:
    """The model's module tree on the meta device: names and shapes, no memory for weights."""
    cls = _model_class(config, model_class)
    with torch.device("meta"):
        return cls(config)


def _linear_modules(model: torch.nn.Module) -> Dict[str, bool]:
    """Name -> ``True`` for a transformers ``Conv1D`` (weight stored ``(in, out)``), ``False`` for an
    ``nn.Linear``: the modules whose weight can be quantized (as in :func:`ds_fpquant.apply`)."""
    from .integration import is_conv1d

    return {name: is_conv1d(m) for name, m in model.named_modules() if type(m) is torch.nn.Linear or is_conv1d(m)}


# ---- quantize_checkpoint --------------------------------------------------------------------------


class _ShardWriter:
    """Collects output tensors and writes a safetensors shard whenever ``max_bytes`` would be
    exceeded; renames the shards ``model-0000i-of-0000n.safetensors`` and writes the index at the end."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: List[List[str]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.directory / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> List[str]:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        umask = os.umask(0)
        os.umask(umask)
        for i, name in enumerate(names):
            os.replace(self.directory / f"shard-{i:05d}.tmp", self.directory / name)
            os.chmod(self.directory / name, 0o666 & ~umask)  # as an ordinary file, not safetensors' 0600
        if n > 1:
            weight_map = {key: name for keys, name in zip(self.shards, names) for key in keys}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def _settings(fmt: str, block, group_size, scale_format: Optional[str], exclude: Sequence[str]):
    """The :class:`~ds_fpquant.config.FPQuantizationConfig` of a checkpoint run, its layout name and
    the ``quantization_config`` fields that describe the codes; ``ValueError``/``TypeError`` for bad
    arguments."""
    from . import checks
    from .api import _check_block
    from .config import DEFAULT_EXCLUDE, FPQuantizationConfig

    if block is not None:
        block = _check_block(block, None, "row")
    if group_size is not None:
        group_size = checks.check_int("group_size", group_size, 1)
    if block is not None and group_size is not None:
        raise ValueError(f"give block={block} or group_size={group_size}, not both")
    if isinstance(exclude, (str, bytes)) or not all(isinstance(p, str) for p in exclude):
        raise TypeError(f"exclude must be a list of regular expressions (str), got {exclude!r}")
    for pattern in exclude:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"exclude pattern {pattern!r} is not a valid regular expression: {exc}") from None
    fp8 = fmt in FP8_DTYPES and scale_format in (None, "fp32")
    if block is None and fmt in FORMATS:
        # the FP8 layout stores row groups as [1, G] blocks; other formats keep row grouping
        block = DEFAULT_BLOCK if group_size is None else ((1, group_size) if fp8 else None)
    if block is not None:
        group_size = None  # the blocks fix the groups
    probe = quantize(torch.zeros(2, 2), fmt, group_size, block=block, scale_format=scale_format,
                     backend="torch")  # every other argument error, before any file is touched
    config = FPQuantizationConfig(fmt=fmt, group_size=group_size, block=block, scale_format=scale_format,
                                  exclude=[*DEFAULT_EXCLUDE, *exclude])
    layout = {"fmt": fmt, "group_size": probe.group_size, "weight_block_size": list(block) if block else None,
              "scale_format": probe.scale_format}
    return config, FP8_METHOD if fp8 else OWN_METHOD, layout


class PartialBlocksWarning(UserWarning):
    """Weights kept in full precision by the ``allow_partial_blocks`` rule of :func:`quantize_checkpoint`."""


#: safetensors dtypes of the weights that can be quantized (fp32 / fp16 / bf16, SPEC 2).
QUANTIZABLE_DTYPES = ("F32", "F16", "BF16")


def quantize_checkpoint(src, dst, fmt: str = "e4m3", *, block: Optional[Tuple[int, int]] = None,
                        group_size: Optional[int] = None, scale_format: Optional[str] = None,
                        exclude: Sequence[str] = (), backend: str = "auto", allow_partial_blocks: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> Dict[str, Any]:
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
            block-FP8 layout (``quant_method: "fp8"``); the rest the ``"ds_fpquant"`` layout.
        block: ``(Br, Bc)`` scale blocks; default ``(128, 128)`` for element formats unless
            ``group_size`` is given (presets bring their own groups).
        group_size: row groups of ``G`` along ``in_features`` instead of blocks.
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

    Returns:
        a summary: ``quantized`` / ``copied`` tensor counts, ``bytes_before`` / ``bytes_after`` of the
        weights, ``shards`` (file names), ``skipped_files`` (other weight formats not copied),
        ``kept_partial`` (weights kept by the ``allow_partial_blocks`` rule), ``quantization_config``.

    Raises:
        ValueError, TypeError: bad arguments, a missing or already-quantized ``src``, a non-empty ``dst``.
    """
    from tqdm.auto import tqdm

    from . import checks
    from .api import BACKENDS

    src = _model_dir(src, "src")
    dst = _new_output_dir(dst, "dst")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ValueError(f"dst={str(dst)!r} must be outside src={str(src)!r}")
    max_shard_bytes = checks.check_int("max_shard_bytes", max_shard_bytes, 1)
    allow_partial_blocks = checks.check_flag("allow_partial_blocks", allow_partial_blocks)
    checks.check_choice("backend", backend, BACKENDS)
    if backend == "cuda" and not torch.cuda.is_available():
        raise ValueError("backend='cuda' needs a CUDA device; none is available here (use 'auto' or 'cpu')")
    config, method, layout = _settings(fmt, block, group_size, scale_format, exclude)
    hf_config = _read_config(src)
    if getattr(hf_config, "quantization_config", None):
        raise ValueError(f"src={str(src)!r} is already quantized: quantization_config="
                         f"{hf_config.quantization_config}")
    files = _shard_files(src)
    headers = _tensor_headers(files)
    meta = _meta_model(hf_config)
    linears, keys = _linear_modules(meta), CheckpointKeys(meta)
    names = [*linears, *expert_parameters(meta)]
    unmatched = [p for p in exclude if not any(re.search(p, name) for name in names)]
    if unmatched:
        raise ValueError(f"exclude patterns {unmatched} match none of the {len(names)} linear modules and expert "
                         f"parameters (e.g. {', '.join(names[:3])}); nothing would be excluded by them")
    stored: Dict[str, str] = {}
    for key in headers:
        name = keys.module(key, ".weight", linears)
        if name is not None and stored.setdefault(name, key) != key:
            raise ValueError(f"{stored[name]} and {key} are both the weight of {name}")
    plan = {key: name for name, key in stored.items() if config.settings_for(name) is not None}
    expert_plan = {key: part for key in headers if key not in plan and (part := keys.part(key)) is not None
                   and config.settings_for(part.target) is not None}
    fused_plan = {key: target for key in headers if (target := keys.fused(key)) is not None
                  and config.settings_for(target) is not None}
    # a stored (E, out, in) stack is written under the per-expert keys the model is released with, if it has them
    unfused = {key: keys.unfuse(key, headers[key][1]) for key in fused_plan}
    keys.check_parts(expert_plan, {key: headers[key][1] for key in expert_plan})
    bad_stacks = {key: headers[key][1] for key, target in fused_plan.items() if headers[key][1] != keys.shape(target)}
    if bad_stacks:
        raise ValueError(f"these expert stacks do not have the (experts, out, in) shape of the model's parameter: "
                         f"{bad_stacks}")
    bad = {key: headers[key][0] for key in [*plan, *expert_plan, *fused_plan] if headers[key][0] not in QUANTIZABLE_DTYPES}
    if bad:
        raise ValueError(f"these linear weights cannot be quantized (dtypes {', '.join(QUANTIZABLE_DTYPES)} only): "
                         f"{bad}; exclude them with exclude=[...]")
    kept_partial = []
    if method == FP8_METHOD and not allow_partial_blocks:
        # what transformers' FP8 loader (and others inferring the block as rows // scale_rows) misreads or refuses
        block = layout["weight_block_size"]
        for key, name in list(plan.items()):
            if linears[name] or not _whole_blocks(headers[key][1], block):
                kept_partial.append(name)
                del plan[key]
        matrices = [*((p.target, headers[k][1]) for k, p in expert_plan.items()),
                    *((t, (rows, headers[k][1][2])) for k, t in fused_plan.items() if unfused[k]
                      for _, rows in unfused[k].values()),
                    *((t, headers[k][1][1:]) for k, t in fused_plan.items() if not unfused[k])]
        partial_targets = {target for target, shape in matrices if not _whole_blocks(shape, block)}
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

    def quantize_matrix(weight: torch.Tensor, target: str):
        return quantize(weight.to(device), **config.settings_for(target), backend=backend)

    def expert_matrices(target: str, part_keys: Sequence[str], tensors: Sequence[torch.Tensor]):
        """(checkpoint base name, QuantizedTensor) of one expert's parts: quantized together as the row of the
        fused parameter they form (gate over up), as apply quantizes it, then split."""
        rows = [t.shape[0] for t in tensors]
        block_rows = (layout["weight_block_size"] or (1,))[0]
        if all(n % block_rows == 0 for n in rows[:-1]):
            qts = split_rows(quantize_matrix(torch.cat(tensors), target), rows)
        else:  # a block of rows would span two parts: each part gets its own blocks
            qts = [quantize_matrix(t, target) for t in tensors]
        return [(k[:-len(".weight")], qt) for k, qt in zip(part_keys, qts)]

    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    try:
        writer = _ShardWriter(dst, max_shard_bytes)
        dtypes: Counter = Counter()
        bytes_before = bytes_after = 0
        pending: Dict[Tuple[str, int], Dict[int, Tuple[str, torch.Tensor]]] = {}  # an expert's parts read so far
        for key, tensor in tqdm(_iter_tensors(files), total=len(headers), desc="quantize", unit="tensor",
                                disable=not progress):
            if key in plan:
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
                qts = [quantize_matrix(tensor[e], fused_plan[key]) for e in range(tensor.shape[0])]
                _write_stack(writer, key, qts, method)
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
                _write_quantized(writer, base, qt, method)
                bytes_after += qt.nbytes
            sources = tensors if key in expert_plan else (tensor,)
            dtypes[str(tensor.dtype).replace("torch.", "")] += len(sources)
            bytes_before += sum(t.numel() * t.element_size() for t in sources)
        if pending:
            raise ValueError(f"src={str(src)!r}: these experts lack some of their matrices (gate / up): "
                             f"{sorted(f'{target}[{e}]' for target, e in pending)}")
        shards = writer.close()
        quantized = [*plan, *expert_plan, *fused_plan]
        qconfig = _quantization_config(method, layout, not_converted, [n for n in plan.values() if linears[n]],
                                       dtypes.most_common(1)[0][0] if dtypes else "float32")
        skipped = _copy_other_files(src, dst, qconfig)
    except BaseException:
        _clear_output(dst, created)
        raise
    return {"quantized": len(quantized), "copied": len(headers) - len(quantized), "bytes_before": bytes_before,
            "bytes_after": bytes_after, "shards": shards, "skipped_files": skipped, "kept_partial": kept_partial,
            "quantization_config": qconfig}


def _new_output_dir(path, name: str) -> Path:
    """``path`` as an output directory that is new or empty (``TypeError`` / ``ValueError``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike directory, got {type(path).__name__}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{name}={str(path)!r} exists and is not an empty directory; choose a new one")
    return path


def _clear_output(directory: Path, created: bool) -> None:
    """Leave no half-written checkpoint behind: remove what was written (and the folder if it was made)."""
    if created:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for child in directory.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()


def _quantization_config(method: str, layout: Dict[str, Any], not_converted: List[str], transposed: List[str],
                         weight_dtype: str) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config`` for a checkpoint in ``method``'s layout."""
    qconfig: Dict[str, Any] = {"quant_method": method, "fmt": layout["fmt"]}
    if method == FP8_METHOD:
        qconfig.update(activation_scheme="dynamic", weight_block_size=layout["weight_block_size"])
    else:
        qconfig.update(layout, codes="uint8, SPEC 6 row packing")
    qconfig.update(modules_to_not_convert=not_converted, ignored_layers=not_converted,
                   ds_fpquant={"version": __version__, "transposed": transposed, "weight_dtype": weight_dtype})
    return qconfig


def _write_quantized(writer: "_ShardWriter", base: str, qt, method: str) -> None:
    """Add the tensors of ``qt`` as ``<base>.weight``, ``<base>.weight_scale_inv`` / ``.weight_scale`` / ... ."""
    for part_name, part in _layout_tensors(qt, method).items():
        writer.add(f"{base}.{part_name}", part)


def _write_stack(writer: "_ShardWriter", key: str, qts, method: str) -> None:
    """Add the experts ``qts`` of a stored stack as ``<key>`` ``(E, ...)`` plus ``<key>_scale_inv`` / ... ."""
    stacked = [_layout_tensors(qt, method) for qt in qts]
    for part_name in stacked[0]:
        writer.add(key + part_name[len("weight"):], torch.stack([t[part_name] for t in stacked]))


def _whole_blocks(shape: Sequence[int], block: Sequence[int]) -> bool:
    """Whether a loader that infers the block from the scales' shape (``rows // scale_rows``, as
    transformers' FP8 loader does) reads a ``shape`` matrix with ``block`` blocks correctly: each side is
    a multiple of its block or fits in one."""
    return all(n <= b or n % b == 0 for n, b in zip(shape, block))


def _layout_tensors(qt, method: str) -> Dict[str, torch.Tensor]:
    """The tensors that store ``qt`` in the checkpoint layout, by name (``weight``, ``weight_scale_inv``,
    ``weight_scale``, ``weight_scale_2``), on the CPU."""
    if method == FP8_METHOD:
        return {"weight": qt.codes.view(FP8_DTYPES[qt.fmt]).cpu(), "weight_scale_inv": qt.scales.cpu()}
    parts = {"weight": qt.codes.cpu(),
             "weight_scale": (qt.scales.view(torch.float8_e4m3fn) if qt.fmt == "nvfp4" else qt.scales).cpu()}
    if qt.tensor_scale is not None:
        parts["weight_scale_2"] = qt.tensor_scale.cpu()
    return parts


def _copy_other_files(src: Path, dst: Path, qconfig: Dict[str, Any]) -> List[str]:
    """Copy everything but the weights (tokenizer, pooling config, ...), write config.json with
    ``quantization_config``; returns the weight files of other formats that were left out."""
    skipped = []

    def ignore(directory, names):
        left_out = []
        for name in names:
            path = Path(directory) / name
            if path.is_file() and (name.endswith(".safetensors") or name == SAFETENSORS_INDEX):
                left_out.append(name)
            elif path.is_file() and (name.endswith(OTHER_WEIGHT_SUFFIXES) or name.endswith(".bin.index.json")):
                left_out.append(name)
                skipped.append(str(path.relative_to(src)))
        return left_out

    shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
    config = json.loads((src / CONFIG).read_text())
    config["quantization_config"] = qconfig
    (dst / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return skipped


# ---- save_quantized -------------------------------------------------------------------------------


def _quantized_parts(model: torch.nn.Module):
    """(name -> (QuantizedTensor, bias)) of the FPQuantizedLinear layers and (``<module>.<param>`` ->
    per-expert QuantizedTensors) of the quantized expert stacks of ``model``."""
    from .experts import _expert_views
    from .module import FPQuantizedLinear, is_weight_quantized

    layers, stacks = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, FPQuantizedLinear):
            layers[name] = (module.quantized_weight, module.bias)
        elif is_weight_quantized(module):
            raise ValueError(f"{name} is a tensor-parallel shard quantized in place (AutoTP): save the tp=1 model, "
                             f"or quantize the original checkpoint with `ds-fpquant quantize`")
        for pname, meta in getattr(module, "_fpq_experts", {}).items():
            stacks[f"{name}.{pname}" if name else pname] = _expert_views(module, pname, meta)
    return layers, stacks


def save_quantized(model: torch.nn.Module, directory, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   allow_partial_blocks: bool = True) -> Dict[str, Any]:
    """Write a quantized transformers model (from :func:`ds_fpquant.apply`, ``init_inference``'s
    ``engine.module`` at tp=1, or :func:`load_quantized`) as the checkpoint :func:`quantize_checkpoint`
    would write for it: codes and scales as they are (nothing is quantized again), expert stacks under
    the per-expert keys the model is released with, ``config.json`` with ``quantization_config``.
    ``model.save_pretrained(directory)`` of a quantized model calls this.

    Args:
        model: a transformers ``PreTrainedModel`` with quantized layers, all with one format and scaling
            (``fmt``, ``group_size`` / ``block``, ``scale_format``: a checkpoint describes one).
        directory: output directory; must not exist or be empty.
        max_shard_bytes: the largest output shard.
        allow_partial_blocks: block-FP8 layout: weights transformers' FP8 loader would misread (see
            :func:`quantize_checkpoint`) cannot be kept in full precision here (the model no longer holds
            it); ``True`` (default) writes them with a :class:`PartialBlocksWarning`, ``False`` raises.

    Returns:
        the summary :func:`quantize_checkpoint` returns (``bytes_before`` is the full-precision size).

    Raises:
        TypeError, ValueError: not a transformers model, no quantized layers, layers with different
            settings, AutoTP shards, a non-empty ``directory``, partial blocks with
            ``allow_partial_blocks=False``; nothing is written then.
    """
    from . import checks

    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    directory = _new_output_dir(directory, "directory")
    max_shard_bytes = checks.check_int("max_shard_bytes", max_shard_bytes, 1)
    allow_partial_blocks = checks.check_flag("allow_partial_blocks", allow_partial_blocks)
    layers, stacks = _quantized_parts(model)
    if not layers and not stacks:
        raise ValueError(f"{type(model).__name__} holds no ds_fpquant-quantized layers; save it with save_pretrained")
    qts = {**{name: qt for name, (qt, _) in layers.items()}, **{name: qts[0] for name, qts in stacks.items()}}
    settings = {name: (qt.fmt, qt.group_size, qt.block, qt.scale_format, qt.grouping) for name, qt in qts.items()}
    first = next(iter(settings.values()))
    differ = {name: s for name, s in settings.items() if s != first}
    if differ:
        raise ValueError(f"a checkpoint holds one format and scaling; these layers differ from "
                         f"{next(iter(settings))} {first} (fmt, group_size, block, scale_format, grouping): {differ}")
    fmt, group_size, block, scale_format, _ = first
    method = FP8_METHOD if fmt in FP8_DTYPES and scale_format == "fp32" else OWN_METHOD
    block_size = list(block) if block else ([1, group_size] if method == FP8_METHOD else None)
    meta = _meta_model(config.__class__.from_dict(config.to_dict()), type(model))
    linears, keys = _linear_modules(meta), CheckpointKeys(meta)
    partial = [n for n, qt in qts.items() if method == FP8_METHOD and (linears.get(n) or not _whole_blocks(qt.shape, block_size))]
    if partial and not allow_partial_blocks:
        raise ValueError(f"these quantized weights would be misread by transformers' FP8 loader (blocks cut by the "
                         f"matrix edge, or Conv1D): {partial}; pass allow_partial_blocks=True to write them anyway")
    if partial:
        warnings.warn(f"written although transformers' FP8 loader would misread or refuse them: {', '.join(partial)}",
                      PartialBlocksWarning, stacklevel=2)
    owned = tuple(f"{name}." for name in layers) + tuple(f"{name}_" for name in stacks)

    def expert_rows(names, e: int):
        """(part, checkpoint key, rows) of expert ``e``'s matrices, gate before up."""
        return sorted((part.part, key, rows) for key, (part, rows) in names.items() if part.expert == e)

    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        writer, seen, copied = _ShardWriter(directory, max_shard_bytes), set(), 0
        bytes_before = bytes_after = 0
        for key, tensor in model.state_dict().items():
            if key.startswith(owned) or key.endswith("._extra_state"):
                continue
            if tensor.numel() and tensor.data_ptr() in seen:  # a tied weight: the loader ties it again
                continue
            seen.add(tensor.data_ptr())
            writer.add(key, tensor.detach().cpu())
            copied += 1
        for name, (qt, bias) in layers.items():
            _write_quantized(writer, name, qt, method)
            if bias is not None:
                writer.add(f"{name}.bias", bias.detach().cpu())
            bytes_before += math.prod(qt.shape) * qt.dtype.itemsize
            bytes_after += qt.nbytes
        for name, experts in stacks.items():
            shape = (len(experts), *experts[0].shape)
            names = keys.unfuse(name, shape)
            block_rows = block_size[0] if block_size else 1
            if names and all(rows % block_rows == 0 for _, _, rows in expert_rows(names, 0)[:-1]):
                for e, qt in enumerate(experts):
                    parts = expert_rows(names, e)
                    for (_, key, _), piece in zip(parts, split_rows(qt, [rows for _, _, rows in parts])):
                        _write_quantized(writer, key[:-len(".weight")], piece, method)
            else:  # no per-expert keys for this model, or a block of rows spans gate and up: stored as a stack
                _write_stack(writer, name, experts, method)
            bytes_before += math.prod(shape) * experts[0].dtype.itemsize
            bytes_after += sum(qt.nbytes for qt in experts)
        shards = writer.close()
        layout = {"fmt": fmt, "group_size": group_size, "weight_block_size": block_size, "scale_format": scale_format}
        not_converted = [n for n in linears if n not in layers] + [n for n in keys.params if n not in stacks]
        qconfig = _quantization_config(method, layout, not_converted, [n for n in layers if linears.get(n)],
                                       str(next(iter(qts.values())).dtype).replace("torch.", ""))
        config.save_pretrained(directory)
        data = json.loads((directory / CONFIG).read_text())
        data["architectures"] = [type(model).__name__]  # as save_pretrained writes it: the class to build
        data["quantization_config"] = qconfig
        (directory / CONFIG).write_text(json.dumps(data, indent=2) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)
    except BaseException:
        _clear_output(directory, created)
        raise
    return {"quantized": len(qts), "copied": copied, "bytes_before": bytes_before, "bytes_after": bytes_after,
            "shards": shards, "skipped_files": [], "kept_partial": [], "quantization_config": qconfig}


def _save_pretrained(self, save_directory, is_main_process: bool = True, max_shard_size="50GB",
                     safe_serialization: bool = True, **kwargs):
    """``save_pretrained`` of a quantized model: :func:`save_quantized` (installed on the model by
    :func:`ds_fpquant.apply` and :func:`load_quantized`). Arguments it cannot honour are refused by name."""
    from transformers.utils.hub import convert_file_size_to_int

    refused = {k: v for k, v in kwargs.items() if v not in (None, False)}
    if refused or safe_serialization is not True:
        raise ValueError(f"save_pretrained of a ds_fpquant-quantized model writes its codes and scales with "
                         f"ds_fpquant.save_quantized(model, directory) (safetensors, max_shard_size, "
                         f"is_main_process); it cannot honour {refused or {'safe_serialization': safe_serialization}}. "
                         f"Or quantize the original checkpoint with `ds-fpquant quantize SRC DST`")
    if is_main_process:
        save_quantized(self, save_directory, max_shard_bytes=convert_file_size_to_int(max_shard_size))


def enable_save_pretrained(model: torch.nn.Module) -> None:
    """Make ``model.save_pretrained`` (a transformers model's) write the quantized checkpoint
    (:func:`save_quantized`) instead of failing on the quantized layers."""
    if callable(getattr(model, "save_pretrained", None)) and hasattr(getattr(model, "config", None), "to_dict"):
        model.save_pretrained = types.MethodType(_save_pretrained, model)


# ---- load_quantized -------------------------------------------------------------------------------


def _pair(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))


def _check_qconfig(qconfig, path: Path) -> Dict[str, Any]:
    """The ``quantization_config`` of a checkpoint, checked field by field (``ValueError``)."""
    where = f"{str(path / CONFIG)!r}: quantization_config"
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") not in (FP8_METHOD, OWN_METHOD):
        raise ValueError(f"{where}={qconfig!r}; expected quant_method {FP8_METHOD!r} or {OWN_METHOD!r} "
                         f"(write one with `ds-fpquant quantize`)")
    block = qconfig.get("weight_block_size")
    if qconfig["quant_method"] == FP8_METHOD:
        if block is None:
            raise ValueError(f"{where} has no weight_block_size: per-tensor FP8 checkpoints are not supported; "
                             f"ds_fpquant reads block-FP8 checkpoints")
    else:
        if qconfig.get("fmt") not in (*FORMATS, *PRESETS):
            raise ValueError(f"{where}.fmt={qconfig.get('fmt')!r}; allowed: {', '.join([*FORMATS, *PRESETS])}")
        group_size = qconfig.get("group_size")
        if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1):
            raise ValueError(f"{where}.group_size={group_size!r} must be an int >= 1")
        if qconfig.get("scale_format") not in ("fp32", "e8m0", "e4m3"):
            raise ValueError(f"{where}.scale_format={qconfig.get('scale_format')!r}; allowed: fp32, e8m0, e4m3")
    if block is not None and not _pair(block):
        raise ValueError(f"{where}.weight_block_size={block!r} must be [Br, Bc], two ints >= 1")
    own = qconfig.get("ds_fpquant") or {}
    if not isinstance(own, dict):
        raise ValueError(f"{where}.ds_fpquant={own!r} must be an object")
    if own.get("weight_dtype", "float32") not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{where}.ds_fpquant.weight_dtype={own.get('weight_dtype')!r}; allowed: float32, "
                         f"float16, bfloat16")
    transposed = own.get("transposed", [])
    if not isinstance(transposed, list) or not all(isinstance(n, str) for n in transposed):
        raise ValueError(f"{where}.ds_fpquant.transposed={transposed!r} must be a list of module names")
    return own


#: The tensors of one quantized weight in each layout (besides ``weight``); NVFP4 adds ``weight_scale_2``.
REQUIRED_PARTS = {FP8_METHOD: ("weight", "weight_scale_inv"), OWN_METHOD: ("weight", "weight_scale")}


def _quantized_tensor(name: str, parts: Dict[str, torch.Tensor], shape, qconfig: Dict[str, Any], dtype: torch.dtype):
    """The checked :class:`QuantizedTensor` of the weight of module ``name`` from its checkpoint tensors."""
    from .api import QuantizedTensor

    method = qconfig["quant_method"]
    required = REQUIRED_PARTS[method] + (("weight_scale_2",) if qconfig.get("fmt") == "nvfp4" else ())
    missing = [f"{name}.{p}" for p in required if p not in parts]
    extra = [f"{name}.{p}" for p in parts if p not in required]
    if missing or extra:
        raise ValueError(f"{name}: a {method!r} weight has the tensors {', '.join(required)}; "
                         f"missing: {missing}, unexpected: {extra}")
    weight = parts["weight"]
    if method == FP8_METHOD:
        fmts = {v: k for k, v in FP8_DTYPES.items()}
        scales = parts["weight_scale_inv"]
        if weight.dtype not in fmts or scales.dtype not in (*FP8_SCALE_DTYPES, *E8M0_SCALE_DTYPES):
            raise ValueError(f"{name}: a quant_method='fp8' weight is float8_e4m3fn/float8_e5m2 with a float32/bfloat16/"
                             f"float16 or E8M0 (float8_e8m0fnu, uint8) weight_scale_inv; got {weight.dtype} and "
                             f"{scales.dtype}")
        br, bc = qconfig["weight_block_size"]
        e8m0 = scales.dtype in E8M0_SCALE_DTYPES  # 2^(byte - 127), as DeepSeek-V3.1-style ue8m0 releases store them
        qt = QuantizedTensor(codes=weight.view(torch.uint8),
                             scales=scales.view(torch.uint8) if e8m0 else scales.to(torch.float32),  # exact widening
                             shape=torch.Size(shape), dtype=dtype, fmt=fmts[weight.dtype], group_size=bc,
                             block=(br, bc), scale_format="e8m0" if e8m0 else "fp32")
    else:
        block = qconfig.get("weight_block_size")
        scales = parts["weight_scale"]
        if weight.dtype != torch.uint8:
            raise ValueError(f"{name}.weight: a 'ds_fpquant' weight is uint8 packed codes, got {weight.dtype}")
        if qconfig["fmt"] == "nvfp4" and scales.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.weight_scale: NVFP4 group scales are float8_e4m3fn, got {scales.dtype}")
        qt = QuantizedTensor(codes=weight, scales=scales.view(torch.uint8) if qconfig["fmt"] == "nvfp4" else scales,
                             shape=torch.Size(shape), dtype=dtype, fmt=qconfig["fmt"],
                             group_size=block[1] if block else qconfig["group_size"],
                             block=tuple(block) if block else None, scale_format=qconfig["scale_format"],
                             tensor_scale=parts.get("weight_scale_2"))
    try:
        _check_quantized(qt)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    _check_scale_values(name, qt)
    return qt


def _check_scale_values(name: str, qt) -> None:
    """Stored scales must be what SPEC 3 can produce: fp32 scales positive (NaN marks a faulty group),
    NVFP4 scale codes non-negative and a finite tensor scale >= 2^-126; E8M0 bytes are all valid."""
    if qt.scale_format == "fp32":
        bad = ~(torch.isnan(qt.scales) | ((qt.scales > 0) & torch.isfinite(qt.scales)))
        if bool(bad.any()):
            raise ValueError(f"{name}: scales must be finite and > 0 (or NaN for a faulty group, SPEC 3.3); "
                             f"found {qt.scales[bad].reshape(-1)[0].item()!r}")
    if qt.tensor_scale is not None:
        if bool((qt.scales >= 0x80).any()):
            raise ValueError(f"{name}.weight_scale: NVFP4 group scale codes are non-negative e4m3 (SPEC 3.4); "
                             f"found a negative one")
        t = qt.tensor_scale.item()
        if not (math.isfinite(t) and t >= 2.0**-126):
            raise ValueError(f"{name}.weight_scale_2={t!r}: the NVFP4 tensor scale is finite and >= 2^-126 (SPEC 3.4)")


def load_quantized(path, *, model_class=None, backend: str = "auto", compute_dtype: Optional[str] = None):
    """Build the model of a quantized checkpoint with :class:`~ds_fpquant.module.FPQuantizedLinear`
    layers holding the codes and scales as stored: no full-precision copy of a quantized weight is
    ever made (the module tree is built on the meta device and every tensor is assigned from the
    file).

    Reads both layouts of :func:`quantize_checkpoint`, including block-FP8 checkpoints written by
    other tools (``quant_method: "fp8"`` with ``weight_block_size``, e.g. DeepSeek-V3 style).

    Args:
        path: the checkpoint directory (``config.json`` with ``quantization_config``).
        model_class: the transformers class to build; default: ``config.architectures[0]``.
        backend, compute_dtype: as for :class:`~ds_fpquant.module.FPQuantizedLinear`.

    Returns:
        the model on the CPU in eval mode (move it with ``.to(device)``).

    Raises:
        ValueError, TypeError: not a model directory; no or an invalid ``quantization_config``; tensors
            that are missing, damaged or do not fit the model (the message names the module).
    """
    from .integration import _parent
    from .module import FPQuantizedLinear

    path = _model_dir(path, "path")
    hf_config = _read_config(path)
    qconfig = getattr(hf_config, "quantization_config", None)
    own = _check_qconfig(qconfig, path)
    del hf_config.quantization_config  # build the plain model; its linears are replaced below
    dtype = getattr(torch, own.get("weight_dtype") or str(getattr(hf_config, "dtype", None) or "bfloat16").replace(
        "torch.", ""))
    model = _meta_model(hf_config, model_class)
    linears, keys = _linear_modules(model), CheckpointKeys(model)
    files = _shard_files(path)
    headers = _tensor_headers(files)
    code_dtypes = ("F8_E4M3", "F8_E5M2") if qconfig["quant_method"] == FP8_METHOD else ("U8",)
    quantized = {name for key in headers for suffix in SCALE_SUFFIXES
                 if (name := keys.module(key, suffix, linears)) is not None}
    quantized |= {name for key, (dtype_name, _) in headers.items() if dtype_name in code_dtypes
                  and (name := keys.module(key, ".weight", linears)) is not None}
    parts: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name in quantized}
    expert_parts: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}  # target -> (e, part) -> tensors
    fused: Dict[str, Dict[str, torch.Tensor]] = {}  # target -> tensors of a stored (E, ...) stack
    state = {}
    placed: Dict[Tuple, str] = {}  # where each tensor went -> its key: two keys for one place are an error
    for key, tensor in _iter_tensors(files):
        kind, where, part_name = _place(key, quantized, linears, keys)
        slot = (kind, where, part_name) if kind else None
        if slot is not None and placed.setdefault(slot, key) != key:
            raise ValueError(f"{placed[slot]} and {key} are both {part_name} of {getattr(where, 'target', where)}"
                             f"{f' expert {where.expert} part {where.part}' if kind == 'expert' else ''}")
        if kind == "linear":
            parts[where][part_name] = tensor
        elif kind == "expert":
            expert_parts.setdefault(where.target, {}).setdefault((where.expert, where.part), {})[part_name] = tensor
        elif kind == "stack":
            fused.setdefault(where, {})[part_name] = tensor
        else:
            state[key] = tensor
    twice = sorted(set(expert_parts) & set(fused))
    if twice:
        raise ValueError(f"these expert parameters are stored both per expert and as a stack: {twice}")
    biases = {keys.module(key, ".bias", linears): key for key in state}
    transposed = set(own.get("transposed", ()))
    for name, tensors in parts.items():
        module = model.get_submodule(name)
        if linears[name] and name not in transposed:
            raise ValueError(f"{name} is a Conv1D whose quantized weight is not stored as (out, in); "
                             f"only checkpoints listing it in quantization_config.ds_fpquant.transposed are supported")
        shape = tuple(module.weight.shape[::-1]) if linears[name] else tuple(module.weight.shape)
        qt = _quantized_tensor(name, tensors, shape, qconfig, dtype)
        bias = state.pop(biases[name]) if name in biases else None
        if (bias is None) != (module.bias is None):
            raise ValueError(f"{name}: the model {'has' if module.bias is not None else 'has no'} bias, the "
                             f"checkpoint {'has none' if bias is None else 'has one'}")
        if bias is not None and tuple(bias.shape) != (shape[0],):
            raise ValueError(f"{name}.bias has shape {tuple(bias.shape)}; expected ({shape[0]},)")
        parent, child = _parent(model, name)
        setattr(parent, child, FPQuantizedLinear(qt, bias, compute_dtype=compute_dtype, backend=backend))
    for target, by_part in expert_parts.items():
        _load_expert_parts(model, keys, target, by_part, qconfig, dtype, state, backend, compute_dtype)
    for target, tensors in fused.items():
        _load_fused_experts(model, keys, target, tensors, qconfig, dtype, state, backend, compute_dtype)
    _assign_rest(model, state, keys)
    enable_save_pretrained(model)
    return model.eval()


#: The tensors of a stored expert stack ``<p>`` ``(E, ...)``: suffix -> the part name of one weight.
STACK_SUFFIXES = {"_scale_inv": "weight_scale_inv", "_scale_2": "weight_scale_2", "_scale": "weight_scale", "": "weight"}


def _place(key: str, quantized, linears, keys: CheckpointKeys):
    """Where checkpoint tensor ``key`` goes: ``("linear", module, part)`` for a part of a quantized
    linear weight, ``("expert", ExpertPart, part)`` for a per-expert matrix or its scales,
    ``("stack", parameter, part)`` for a stored expert stack, ``(None, None, None)`` for the rest
    (``part``: ``weight``, ``weight_scale_inv``, ``weight_scale`` or ``weight_scale_2``)."""
    for suffix in (".weight", *SCALE_SUFFIXES):
        if not key.endswith(suffix):
            continue
        name = keys.module(key, suffix, linears)
        if name in quantized:
            return "linear", name, suffix[1:]
        part = keys.part(key[:-len(suffix)] + ".weight")
        if part is not None:
            return "expert", part, suffix[1:]
    for suffix, part_name in STACK_SUFFIXES.items():
        target = keys.fused(key[:len(key) - len(suffix)]) if key.endswith(suffix) else None
        if target is not None:
            return "stack", target, part_name
    return None, None, None


def _load_expert_parts(model, keys: CheckpointKeys, target: str, by_part, qconfig, dtype, state, backend,
                       compute_dtype) -> None:
    """Install the expert parameter ``target`` from its per-expert matrices (``by_part[(e, part)]`` =
    ``{"weight": ..., "weight_scale_inv": ...}``): quantized ones become the module's quantized experts,
    full-precision ones (kept by the writer) are stacked into ``state`` for the plain parameter."""
    module_name, pname = keys.params[target]
    module = model.get_submodule(module_name)
    n_experts, out_features, in_features = module._parameters[pname].shape
    n_parts = 1 + max(p for _, p in by_part)
    missing = [f"expert {e} part {p}" for e in range(n_experts) for p in range(n_parts) if (e, p) not in by_part]
    extra = sorted(key for key in by_part if key[0] >= n_experts)
    if missing or extra:
        raise ValueError(f"{target}: the checkpoint's per-expert matrices do not fill the ({n_experts}, {out_features}, "
                         f"{in_features}) parameter; missing: {missing}, beyond the {n_experts} experts: {extra}")
    no_weight = [f"expert {e} part {p}" for (e, p), t in sorted(by_part.items()) if "weight" not in t]
    if no_weight:
        raise ValueError(f"{target}: the checkpoint has scales but no weight for {no_weight}")
    is_quantized = {p: len(t) > 1 or t["weight"].dtype not in (torch.float32, torch.float16, torch.bfloat16)
                    for p, t in by_part.items()}
    if not any(is_quantized.values()):
        state[target] = torch.stack([torch.cat([by_part[(e, p)]["weight"] for p in range(n_parts)])
                                     for e in range(n_experts)])
        return
    if not all(is_quantized.values()):
        raise ValueError(f"{target}: some expert matrices are quantized and some are not; ds_fpquant loads an expert "
                         f"parameter whole, quantized or not")
    qts = []
    for e in range(n_experts):
        pieces = [_quantized_tensor(f"{target}[expert {e}, part {p}]", by_part[(e, p)],
                                    (by_part[(e, p)]["weight"].shape[0], in_features), qconfig, dtype)
                  for p in range(n_parts)]
        try:
            qts.append(join_rows(pieces))
        except ValueError as exc:
            raise ValueError(f"{target}[expert {e}]: {exc}") from None
    if tuple(qts[0].shape) != (out_features, in_features):
        raise ValueError(f"{target}: the expert matrices join to {tuple(qts[0].shape)}; the model needs "
                         f"({out_features}, {in_features})")
    _install(module, pname, target, qts, backend, compute_dtype)


def _install(module, pname: str, target: str, qts, backend, compute_dtype) -> None:
    try:
        install_quantized_experts(module, pname, qts, compute_dtype=compute_dtype, backend=backend)
    except ValueError as exc:
        raise ValueError(f"{target}: {exc}") from None


def _load_fused_experts(model, keys: CheckpointKeys, target: str, tensors, qconfig, dtype, state, backend,
                        compute_dtype) -> None:
    """Install the expert parameter ``target`` from a stored stack (``<target>`` ``(E, ...)`` plus
    ``<target>_scale_inv`` / ``_scale`` / ``_scale_2``, transformers' fused FP8 layout)."""
    module_name, pname = keys.params[target]
    module = model.get_submodule(module_name)
    shape = tuple(module._parameters[pname].shape)
    if set(tensors) == {"weight"} and tensors["weight"].dtype in (torch.float32, torch.float16, torch.bfloat16):
        state[target] = tensors["weight"]
        return
    if any(t.shape[:1] != shape[:1] for t in tensors.values()):
        raise ValueError(f"{target}: a stored expert stack has {shape[0]} experts in its first dimension; got "
                         f"{ {k: tuple(t.shape) for k, t in tensors.items()} }")
    qts = [_quantized_tensor(f"{target}[expert {e}]", {k: t[e] for k, t in tensors.items()}, shape[1:], qconfig, dtype)
           for e in range(shape[0])]
    _install(module, pname, target, qts, backend, compute_dtype)


def _assign_rest(model: torch.nn.Module, state: Dict[str, torch.Tensor], keys: CheckpointKeys) -> None:
    """Assign the unquantized tensors, tie weights, and initialise what no file holds (non-persistent
    buffers such as position ids) the way transformers' ``from_pretrained`` does: every loaded tensor
    and every module without such a buffer is flagged ``_is_hf_initialized``, and
    ``model.initialize_weights()`` runs the model's ``_init_weights`` on the rest."""
    expected = set(model.state_dict())
    renamed, sources = {}, {}
    for key, tensor in state.items():
        name = keys.resolve(key, expected) or key
        if sources.setdefault(name, key) != key:
            raise ValueError(f"{sources[name]} and {key} are both {name}")
        renamed[name] = tensor
    try:
        result = model.load_state_dict(renamed, strict=False, assign=True)
    except RuntimeError as exc:  # shapes that do not fit the model
        raise ValueError(f"the checkpoint's tensors do not fit {type(model).__name__}: {exc}") from None
    non_persistent = dict(model.named_buffers())  # e.g. BERT's position_ids, saved by older versions
    unexpected = [key for key in result.unexpected_keys if key not in non_persistent]
    if unexpected:
        raise ValueError(f"tensors the model has no place for: {unexpected}")
    for key in result.unexpected_keys:
        owner, _, name = key.rpartition(".")
        model.get_submodule(owner)._buffers[name] = renamed[key]
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint lacks these weights of {type(model).__name__}: {missing}")
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor._is_hf_initialized = True
    for module in model.modules():  # only modules left with meta buffers get transformers' init
        pending = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for name in pending:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        module._is_hf_initialized = not pending
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()


# ---- command line -------------------------------------------------------------------------------


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="ds-fpquant quantize",
        description="Quantize the linear and mixture-of-experts weights of a Hugging Face model directory (safetensors) into an FP8/FP6/FP4 "
                    "checkpoint: block-FP8 (quant_method 'fp8', what vLLM and SGLang load) for e4m3/e5m2, the "
                    "ds_fpquant layout otherwise (docs/checkpoints.md). Load it back with ds_fpquant.load_quantized.")
    parser.add_argument("src", help="model directory with config.json and .safetensors weights")
    parser.add_argument("dst", help="output directory (new or empty)")
    parser.add_argument("--fmt", default="e4m3", choices=[*FORMATS, *PRESETS], help="element format or preset "
                        "(default e4m3)")
    scaling = parser.add_mutually_exclusive_group()
    scaling.add_argument("--block", nargs=2, type=int, metavar=("BR", "BC"),
                         help="2-D scale blocks (default 128 128 for element formats)")
    scaling.add_argument("--group-size", type=int, metavar="G", help="row groups of G along in_features instead")
    parser.add_argument("--scale-format", choices=["fp32", "e8m0", "e4m3"],
                        help="scale format (SPEC 3; default fp32, or the preset's own; e4m3 is nvfp4's)")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="regular expression (re.search) of module names to keep unquantized; repeat for more "
                             "(embeddings and output heads are always kept)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "torch"],
                        help="auto: the compiled op, else the torch reference; cuda quantizes on the GPU")
    parser.add_argument("--allow-partial-blocks", action="store_true",
                        help="block-FP8 layout: also write the weights transformers' FP8 loader misreads or refuses (a "
                             "side that is not a multiple of its block and longer than one; GPT-2 Conv1D weights), "
                             "which are otherwise kept in full precision and listed; ds_fpquant's own loader reads them")
    parser.add_argument("--max-shard-size", type=int, default=DEFAULT_MAX_SHARD_BYTES // 2**20, metavar="MIB",
                        help="largest output shard in MiB (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.max_shard_size < 1:
        parser.error(f"--max-shard-size must be >= 1, got {args.max_shard_size}")
    try:
        with warnings.catch_warnings():  # the command prints the kept weights itself
            warnings.simplefilter("ignore", PartialBlocksWarning)
            summary = quantize_checkpoint(args.src, args.dst, args.fmt, block=tuple(args.block) if args.block else None,
                                          group_size=args.group_size, scale_format=args.scale_format,
                                          exclude=args.exclude, backend=args.backend,
                                          allow_partial_blocks=args.allow_partial_blocks,
                                          max_shard_bytes=args.max_shard_size * 2**20, progress=not args.no_progress)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    qc = summary["quantization_config"]
    scaling_text = (f"blocks {qc['weight_block_size'][0]}x{qc['weight_block_size'][1]}" if qc.get("weight_block_size")
                    else f"groups of {qc.get('group_size')}")
    print(f"{args.dst}: {summary['quantized']} linear and expert weights quantized to {args.fmt} ({scaling_text}, "
          f"quant_method {qc['quant_method']!r}), {summary['copied']} tensors copied unchanged; weights "
          f"{summary['bytes_before'] / 2**20:.2f} MiB -> {summary['bytes_after'] / 2**20:.2f} MiB; "
          f"{len(summary['shards'])} shard(s)")
    if qc["modules_to_not_convert"]:
        print(f"kept unquantized: {', '.join(qc['modules_to_not_convert'])}")
    if summary["kept_partial"]:
        print(f"(of these, kept because transformers' FP8 loader would misread them; --allow-partial-blocks writes "
              f"them: {', '.join(summary['kept_partial'])})")
    for name in summary["skipped_files"]:
        print(f"not copied (weights in another format): {name}")
    return 0
