"""DeepSpeed's own objects that :func:`ds_fpquant.patch_deepspeed` replaces, kept so that ds_fpquant calls DeepSpeed's
originals while patched and :func:`ds_fpquant.unpatch_deepspeed` puts them back."""

from __future__ import annotations

from typing import Any, Dict, Tuple

__all__ = ["REPLACED", "original_init_inference"]

#: ``(owner, attribute) -> DeepSpeed's original`` (``None``: the attribute was not in the owner's ``__dict__``);
#: empty while DeepSpeed is not patched.
REPLACED: Dict[Tuple[Any, str], Any] = {}


def original_init_inference():
    """DeepSpeed's own ``deepspeed.init_inference``, patched or not."""
    import deepspeed

    return REPLACED.get((deepspeed, "init_inference"), deepspeed.init_inference)
