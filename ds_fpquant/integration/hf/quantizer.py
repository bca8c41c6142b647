"""``DsFpQuantHfQuantizer``: transformers' ``HfQuantizer`` for ``quant_method: "ds_fpquant"``.

How a load runs (transformers 5's ``from_pretrained``):

1. ``preprocess_model`` (the model on the meta device): the quantizer reads the safetensors headers and plans what
   ds_fpquant installs: for a quantized checkpoint every weight stored quantized in any layout
   :func:`ds_fpquant.load_quantized` reads (:func:`~ds_fpquant.checkpoint.reader.plan_quantized`), for a
   full-precision one the linear and expert weights the ``fp_quantization`` settings select
   (:func:`~ds_fpquant.checkpoint.reader.plan_quantizing`, which checks patterns and shapes before any tensor is
   read). Those weights are hidden from the model's state dict for the load, and their checkpoint keys marked as
   ds_fpquant's (``_keys_to_ignore_on_load_unexpected``): transformers' loader neither reads, nor allocates, nor
   initialises them.
2. transformers' loader reads every other tensor (embeddings, norms, heads, excluded layers) its own way.
3. ``postprocess_model``: ds_fpquant reads its keys, one tensor at a time, with the same code as
   :func:`ds_fpquant.load_quantized` (:func:`~ds_fpquant.checkpoint.reader.read_quantized` /
   :func:`~ds_fpquant.checkpoint.reader.read_quantizing`), so the codes and scales are the same bits; the new
   layers go to the device of their neighbours (``device_map``). No full-precision copy of a quantized weight is
   made (quantizing while loading holds one full-precision tensor at a time).

``save_pretrained`` then writes the ds_fpquant layout (:func:`ds_fpquant.save_quantized`) and
``model.dequantize()`` gives plain ``nn.Linear`` layers and expert parameters holding the dequantized weights.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Dict, Optional, Set

import torch
from transformers.quantizers.base import HfQuantizer

from ds_fpquant.integration.hf.names import METHOD

__all__ = ["DsFpQuantHfQuantizer", "FOREIGN_METHODS", "merge_quantization_configs"]

logger = logging.getLogger(__name__)

#: quant_methods of layouts transformers owns that ``quantization_config=DsFpQuantConfig(...)`` loads through
#: ds_fpquant instead (each one :func:`ds_fpquant.load_quantized` reads).
FOREIGN_METHODS = ("fp8", "compressed-tensors", "mxfp4", "modelopt")


def merge_quantization_configs(original):
    """transformers' ``AutoHfQuantizer.merge_quantization_configs``, except that a :class:`DsFpQuantConfig` given
    for a checkpoint of a layout in :data:`FOREIGN_METHODS` takes it over (logged once per load): the checkpoint's
    own ``quantization_config`` becomes its :attr:`~DsFpQuantConfig.checkpoint`."""
    from ds_fpquant.integration.hf.config import DsFpQuantConfig

    def merge(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, DsFpQuantConfig):
            stored = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
            method = stored.get("quant_method")
            if method in FOREIGN_METHODS:
                logger.warning("loading this quant_method=%r checkpoint through ds_fpquant (quantization_config="
                               "DsFpQuantConfig); without it transformers' own %r quantizer loads it", method, method)
                return DsFpQuantConfig(checkpoint=stored, **quantization_config_from_args.fields)
            if method == METHOD:
                merged = DsFpQuantConfig.from_dict(stored)
                merged.fields, merged.section = quantization_config_from_args.fields, quantization_config_from_args.section
                return merged
        return original(cls, quantization_config, quantization_config_from_args)

    merge.ds_fpquant_original = original
    return merge


class _HideFromStateDict:
    """A state-dict post hook that leaves out the names ds_fpquant loads (a plain object: the model stays picklable
    while it is installed)."""

    def __init__(self, names: Set[str]):
        self.names = names

    def __call__(self, module, state_dict, prefix, local_metadata):
        for name in self.names:
            state_dict.pop(prefix + name, None)


class DsFpQuantHfQuantizer(HfQuantizer):
    """``HfQuantizer`` of ``quant_method: "ds_fpquant"`` (module docstring). ``pre_quantized``: a quantized
    checkpoint (its ``quantization_config``, or a foreign one taken over by a given :class:`DsFpQuantConfig`), else
    quantize while loading with the config's ``fp_quantization`` fields."""

    requires_calibration = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._device_map = None
        self._pending: Optional[Dict[str, Any]] = None

    def validate_environment(self, device_map=None, **kwargs):
        config = self.quantization_config
        if self.pre_quantized and config.checkpoint is None:
            raise ValueError("quantization_config says quant_method='ds_fpquant' but carries no checkpoint layout "
                             "description; write the checkpoint with `ds-fpquant quantize` or ds_fpquant.save_quantized")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("device_map with 'disk': ds_fpquant's quantized layers are not offloaded to disk; map "
                             "them to 'cpu' or a GPU")

    def update_device_map(self, device_map):
        self._device_map = device_map
        return device_map

    # 1. before the loader: plan, and hide what ds_fpquant loads
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from ds_fpquant.checkpoint import layouts
        from ds_fpquant.checkpoint.reader import plan_quantized, plan_quantizing

        files = [Path(f) for f in checkpoint_files or ()]
        if not files or any(f.suffix != ".safetensors" for f in files):
            raise ValueError(f"ds_fpquant loads safetensors checkpoints; from_pretrained found {checkpoint_files}")
        directory = files[0].parent
        config = self.quantization_config
        if self.pre_quantized:
            if config.checkpoint.get("quant_method") == "mxfp4":  # gpt-oss: its own reader builds its own model
                raise ValueError("gpt-oss mxfp4 checkpoints load through ds_fpquant.load_quantized(path); "
                                 "from_pretrained with DsFpQuantConfig does not read them (yet)")
            plan = plan_quantized(model, directory, layouts.reading_for(config.checkpoint, directory), model.config)
            experts = plan.expert_targets()
            linears = set(plan.quantized)
        else:
            plan = plan_quantizing(model, directory, config.settings(), model.config)
            linears = set(plan.selected.linears.values())
            experts = {part.target for part in plan.selected.experts.values()} | set(plan.selected.stacks.values())
        hidden = {f"{name}.{p}" for name in linears for p in ("weight", "bias")} | set(experts)
        expert_modules = {plan.keys.params[target][0] for target in experts}
        patterns = {re.escape(name) + r"\." for name in linears | expert_modules}
        handle = model.register_state_dict_post_hook(_HideFromStateDict(hidden))
        ignored = model.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | patterns
        self._pending = dict(plan=plan, owned=plan.owned(), handle=handle, ignored=ignored,
                             modules=sorted(linears | expert_modules))
        return model

    # 3. after the loader: read ds_fpquant's tensors into the model
    def _process_model_after_weight_loading(self, model, **kwargs):
        from ds_fpquant.checkpoint.reader import read_quantized, read_quantizing
        from ds_fpquant.checkpoint.save_hook import enable_save_pretrained

        pending, self._pending = self._pending, None
        pending["handle"].remove()
        if pending["ignored"] is _UNSET:
            del model._keys_to_ignore_on_load_unexpected
        else:
            model._keys_to_ignore_on_load_unexpected = pending["ignored"]
        plan, config = pending["plan"], self.quantization_config
        if self.pre_quantized:
            section = config.settings()
            state = read_quantized(model, plan, backend=section.backend, compute_dtype=section.compute_dtype,
                                   only=pending["owned"])
        else:
            state = read_quantizing(model, plan, only=pending["owned"])
        for target, tensor in state.items():  # expert stacks a quantized checkpoint keeps in full precision
            module_name, pname = plan.keys.params[target]
            model.get_submodule(module_name)._parameters[pname] = torch.nn.Parameter(tensor, requires_grad=False)
        for name in pending["modules"]:
            _to_device_of_neighbours(model, name, self._device_map)
        enable_save_pretrained(model)
        return model

    def _dequantize(self, model, dtype=None):
        from ds_fpquant.integration.hf.dequantize import dequantize_model

        model = dequantize_model(model, dtype)
        model.__dict__.pop("save_pretrained", None)  # transformers' own again
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters on the quantized layers (ds_fpquant.integration.hf.lora)

    @property
    def is_compileable(self) -> bool:
        return True


_UNSET = object()


def _to_device_of_neighbours(model: torch.nn.Module, name: str, device_map) -> None:
    """Move the module ``name`` (built on the CPU) to the device ``device_map`` gives it: a device for the whole
    model, the entry of its longest prefix in a dict, else (``"auto"``) the device of its parent's loaded tensors."""
    module = model.get_submodule(name)
    device = None
    if isinstance(device_map, (str, torch.device, int)) and str(device_map) not in ("auto", "balanced",
                                                                                     "balanced_low_0", "sequential"):
        device = device_map
    elif isinstance(device_map, dict):
        prefixes = [p for p in device_map if p == "" or name == p or name.startswith(p + ".")]
        device = device_map[max(prefixes, key=len)] if prefixes else None
    if device is None:
        parent = model.get_submodule(name.rpartition(".")[0])
        loaded = [t.device for t in [*parent.parameters(), *parent.buffers()] if not t.is_meta]
        device = loaded[0] if loaded else "cpu"
    module.to(device)
