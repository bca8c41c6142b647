"""Hugging Face model directories as ds_fpquant reads and writes them.

Reading: ``config.json`` (through transformers), the safetensors shards (one file or an index), every
tensor's dtype and shape from the headers, the tensors one at a time, and the model's module tree built on
the meta device. Writing: shards of bounded size (:class:`ShardWriter`), an output folder that is new or
empty and is cleared again if writing fails, and the directory's other files copied beside the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Container, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["model_dir", "read_config", "Shard", "UnindexedTensorsWarning", "shard_files", "tensor_headers",
           "iter_tensors", "read_tensors", "model_class_for", "meta_model", "ShardWriter", "new_output_dir", "clear_output",
           "copy_other_files"]

CONFIG = "config.json"


SAFETENSORS_INDEX = "model.safetensors.index.json"


SAFETENSORS_SINGLE = "model.safetensors"


#: Weight files of other formats: never copied to DST (they would hold the unquantized weights).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".ot")


DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


def model_dir(path, name: str) -> Path:
    """``path`` as a Hugging Face model directory (with ``config.json``), or ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike directory, got {type(path).__name__}")
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ValueError(f"{name}={str(path)!r} is not a Hugging Face model directory (no {CONFIG})")
    return path


def read_config(directory: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{str(directory / CONFIG)!r} could not be read by transformers: {exc}") from None


class UnindexedTensorsWarning(UserWarning):
    """Tensors in a shard that the checkpoint's safetensors index does not assign to it (a stale copy in a reused
    folder, a hand-edited checkpoint): ignored, reported once per read."""


class Shard(NamedTuple):
    """One safetensors file and the tensor names to take from it: those the index assigns to it, or every name
    in it (``keys=None``) for a checkpoint without an index."""

    path: Path
    keys: Optional[FrozenSet[str]]


def _plain_file_name(name, index: Path) -> str:
    """``name`` if it is a plain file name inside the index's directory (no separator, no ``..``, not absolute),
    else ``ValueError``: an index must not send a reader outside its checkpoint (``:`` too: a Windows drive)."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\:") \
            or os.sep in name or (os.altsep and os.altsep in name) or os.path.isabs(name):
        raise ValueError(f"{str(index)!r} names the shard {name!r}; a shard must be a plain file name in the "
                         f"checkpoint's directory (no path separator, no '..', not absolute)")
    return name


def shard_files(directory: Path) -> List[Shard]:
    """The checkpoint's shards, in transformers' order of preference: ``model.safetensors`` alone if it is there;
    else as ``model.safetensors.index.json``'s ``weight_map`` assigns each tensor to one file (each file then
    yields only its own tensors); else every ``*.safetensors`` file of ``directory``. A shard that is a symlink (the Hub cache's snapshot layout) is read through it.

    Raises:
        ValueError: an index that is not one, names a shard that is not a plain file name or is missing.
    """
    index = directory / SAFETENSORS_INDEX
    if (directory / SAFETENSORS_SINGLE).is_file():  # transformers reads it before an index, so do we
        return [Shard(directory / SAFETENSORS_SINGLE, None)]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
            if not weight_map:
                raise ValueError("weight_map lists no tensors")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{str(index)!r} is not a safetensors index (no valid weight_map): {exc}") from None
        keys: Dict[str, set] = {}
        for key, name in weight_map.items():
            keys.setdefault(_plain_file_name(name, index), set()).add(key)
        missing = [name for name in keys if not (directory / name).is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names shards that are not there: {missing}")
        return [Shard(directory / name, frozenset(names)) for name, names in keys.items()]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(directory)!r} holds no .safetensors weights (found: "
                         f"{sorted(p.name for p in directory.iterdir())}); save the model with "
                         f"save_pretrained(..., safe_serialization=True) first")
    return [Shard(path, None) for path in files]


def _taken(shard: Shard, names) -> List[str]:
    """The names of ``shard``'s file to read: all, or those the index assigns to it."""
    return list(names) if shard.keys is None else [k for k in names if k in shard.keys]


def tensor_headers(shards: Sequence[Shard]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Every tensor name -> its safetensors dtype (``"F32"``, ``"F8_E4M3"``, ``"U8"``, ...) and shape,
    from the file headers only, each from the shard the index names. Tensors a shard holds but the index does
    not assign to it are left out, with one :class:`UnindexedTensorsWarning`.

    Raises:
        ValueError: a file is not readable safetensors, or lacks a tensor the index assigns to it.
    """
    from safetensors import safe_open

    headers, ignored = {}, []
    for shard in shards:
        try:
            with safe_open(shard.path, framework="pt") as fh:
                names = list(fh.keys())
                for key in _taken(shard, names):
                    piece = fh.get_slice(key)
                    headers[key] = (piece.get_dtype(), tuple(piece.get_shape()))
        except Exception as exc:  # safetensors raises its own SafetensorError for a damaged file
            raise ValueError(f"{str(shard.path)!r} is not a readable safetensors file: {exc}") from None
        if shard.keys is not None:
            absent = sorted(shard.keys - set(names))
            if absent:
                raise ValueError(f"the index assigns {absent[:5]}{' ...' if len(absent) > 5 else ''} to "
                                 f"{shard.path.name!r}, which does not hold them")
            ignored += [f"{shard.path.name}:{k}" for k in names if k not in shard.keys]
    if ignored:
        warnings.warn(f"{len(ignored)} tensor(s) in the shards are not where the safetensors index puts them "
                      f"(stale copies?) and were ignored: {', '.join(ignored[:8])}{' ...' if len(ignored) > 8 else ''}",
                      UnindexedTensorsWarning, stacklevel=3)
    return headers


def iter_tensors(shards: Sequence[Shard], skip: Container[str] = ()) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, one at a time, each from the shard the index names
    (:func:`tensor_headers` reports what is left out); names in ``skip`` (looked up as each one comes, so the
    caller may add to it: tensors it read ahead with :func:`read_tensors`) are not read."""
    from safetensors import safe_open

    for shard in shards:
        with safe_open(shard.path, framework="pt") as fh:
            for key in _taken(shard, fh.keys()):
                if key not in skip:
                    yield key, fh.get_tensor(key)


def read_tensors(shards: Sequence[Shard], keys: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The tensors ``keys``, each from the shard the index names (``KeyError`` for one no shard holds)."""
    from safetensors import safe_open

    out: Dict[str, torch.Tensor] = {}
    for shard in shards:
        wanted = [k for k in keys if k not in out and (shard.keys is None or k in shard.keys)]
        if not wanted:
            continue
        with safe_open(shard.path, framework="pt") as fh:
            held = set(fh.keys())
            out.update({k: fh.get_tensor(k) for k in wanted if k in held})
    missing = [k for k in keys if k not in out]
    if missing:
        raise KeyError(f"no shard holds {missing}")
    return {k: out[k] for k in keys}


def model_class_for(config, model_class=None):
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


def meta_model(config, model_class=None) -> torch.nn.Module:
    """The model's module tree on the meta device: names and shapes, no memory for weights."""
    cls = model_class_for(config, model_class)
    with torch.device("meta"):
        return cls(config)


class ShardWriter:
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


def new_output_dir(path, name: str) -> Path:
    """``path`` as an output directory that is new or empty (``TypeError`` / ``ValueError``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike directory, got {type(path).__name__}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{name}={str(path)!r} exists and is not an empty directory; choose a new one")
    return path


def clear_output(directory: Path, created: bool) -> None:
    """Leave no half-written checkpoint behind: remove what was written (and the folder if it was made)."""
    if created:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for child in directory.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()


def copy_other_files(src: Path, dst: Path, qconfig: Dict[str, Any]) -> List[str]:
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


def write_model_config(directory: Path, model, qconfig: Dict[str, Any]) -> None:
    """Write ``model``'s ``config.json`` (with ``architectures`` the model's class, as ``save_pretrained`` writes it,
    and ``quantization_config`` = ``qconfig``) and its ``generation_config.json`` (if it has one) into ``directory``."""
    model.config.save_pretrained(directory)
    data = json.loads((Path(directory) / CONFIG).read_text())
    data["architectures"] = [type(model).__name__]  # the class to build
    data["quantization_config"] = qconfig
    (Path(directory) / CONFIG).write_text(json.dumps(data, indent=2) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)
