"""Reading checkpoints in tests: every tensor of a directory's ``.safetensors`` files."""

from safetensors import safe_open


def read_tensors(directory) -> dict:
    """Name -> tensor of every tensor in ``directory/*.safetensors``."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out
