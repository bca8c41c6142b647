"""Checkpoint files in tests: every tensor of a directory's ``.safetensors`` files; a hand-built AutoFP8 checkpoint."""

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from unit.tiny_models import tiny_llama


def read_tensors(directory) -> dict:
    """Name -> tensor of every tensor in ``directory/*.safetensors``."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def write_autofp8_checkpoint(out, scale_of) -> dict:
    """A tiny bf16 Llama written to ``out`` as a per-tensor FP8 checkpoint the way AutoFP8 writes one (by hand, from
    its documented conventions): e4m3 ``weight`` ``fl(w / s)`` with ``s = amax / 448`` in fp32, fp32 0-dim
    ``weight_scale`` and ``input_scale`` (``scale_of(name)``, called in module order), ``quant_method: "fp8"``,
    ``activation_scheme: "static"``, ``lm_head`` ignored. Returns the written tensors by name."""
    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(out)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            w = module.weight.data.float()
            scale = (w.abs().amax() / 448.0).reshape(())
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
            state[f"{name}.input_scale"] = scale_of(name)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return state
