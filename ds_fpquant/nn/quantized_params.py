"""A quantized weight held in a module's buffers, for every layer that holds one: ``FPQuantizedLinear``, a layer
quantized in place (``weight``) and a stack of experts (a 3-D parameter ``(E, out, in)``, each expert on its own).

A parameter ``<name>`` is stored as ``uint8`` buffers, so that ``model.half()`` / ``.to(dtype)`` cannot round them:
``<name>_codes`` (the packed codes, SPEC 6), ``<name>_scales`` (the scales' bytes: fp32 scales as their
little-endian bytes, SPEC 6.1; E8M0 bytes and NVFP4 e4m3 codes as they are) and, for NVFP4, ``<name>_tensor_scale``
(the fp32 tensor scale's 4 bytes). A stack has one more leading dimension, one row per expert.

A parameter that runs static per-tensor W8A8 (``activation="e4m3"`` with an ``input_scale``, SPEC 8.3; expert stacks:
one scale for the whole stack) adds ``<name>_input_scale``, a 0-dim fp32 buffer in the state dict, checked finite and
> 0 when installed and when a state dict is loaded; ``model.half()`` / ``.to(dtype)`` keep its fp32 bits (only its
device follows: :class:`KeepInputScales`, the module's ``_apply``).

In-place quantized parameters (:func:`install`) are presented to the module's own forward by a forward pre-hook:
``module.<name>`` is then a :class:`~ds_fpquant.linear.weights.QuantizedWeight` (a stack: a
:class:`~ds_fpquant.linear.weights.QuantizedExperts`), whose ``F.linear`` / ``matmul`` run the fused quantized
linear, and ``None`` again once no forward of the module runs.

Thread safety (issue 43): several threads may run forwards of one module at once (a serving thread pool), each with
its own input dtype. Each forward builds its own stand-in (views of the buffers, in its compute dtype: the layer's
``compute_dtype``, else its input's dtype) and keeps it in per-thread state; what the forward reads as
``module.<name>`` is a :class:`PerThreadStandIn`, which passes every use to the stand-in of the forward running in the
reading thread. The attribute is set when the first forward of the module starts and reset to ``None`` when the last
one ends (a lock counts them; the release hook runs even when the forward raises). Under ``torch.compile`` /
``torch.export`` the traced forward builds its stand-in in the graph as before (no per-thread state is traced).
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from ds_fpquant.linear.w8a8 import check_activation, check_input_scale
from ds_fpquant.linear.weights import DequantizingTensor, QuantizedExperts, QuantizedWeight
from ds_fpquant.numerics.choices import COMPUTE_DTYPE_NAMES
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["COMPUTE_DTYPES", "register_buffers", "buffer_views", "layout", "install", "quantized_params",
           "is_weight_quantized", "quantized_experts", "input_scale_of", "KeepInputScales", "PerThreadStandIn",
           "dequantize_in_place"]

#: ``compute_dtype`` name -> dtype (the names: :data:`ds_fpquant.numerics.choices.COMPUTE_DTYPE_NAMES`).
COMPUTE_DTYPES = dict(zip(COMPUTE_DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16)))

#: The attribute of a module that lists its in-place quantized parameters: ``{name: meta}``.
_PARAMS = "_fpq_params"


def layout(qt: QuantizedTensor) -> Dict:
    """The fields of ``qt`` besides its tensors: what :func:`buffer_views` needs to rebuild it."""
    return dict(shape=qt.shape, scales_shape=tuple(qt.scales.shape), dtype=qt.dtype, fmt=qt.fmt,
                group_size=qt.group_size, scale_format=qt.scale_format, block=qt.block)


def register_buffers(module: torch.nn.Module, name: str, qts: Sequence[QuantizedTensor], stacked: bool) -> None:
    """``<name>_codes``, ``<name>_scales`` and (NVFP4) ``<name>_tensor_scale`` of ``qts``: one tensor (the codes
    themselves, no copy) or, ``stacked``, the tensors of all ``qts`` stacked along a new first dimension."""
    def store(tensors):
        return torch.stack(tensors) if stacked else tensors[0]

    module.register_buffer(f"{name}_codes", store([qt.codes for qt in qts]))
    module.register_buffer(f"{name}_scales", store([qt.scales.contiguous().view(torch.uint8) for qt in qts]))
    if qts[0].tensor_scale is not None:
        module.register_buffer(f"{name}_tensor_scale", store([qt.tensor_scale.reshape(1).view(torch.uint8)
                                                              for qt in qts]))


def buffer_views(module: torch.nn.Module, name: str, meta: Dict, stacked: bool) -> List[QuantizedTensor]:
    """The :class:`QuantizedTensor` of each weight in the buffers of ``<name>`` (views, no copies): one, or one per
    expert of a stack. ``meta`` holds the :func:`layout` fields."""
    codes = getattr(module, f"{name}_codes")
    scales = getattr(module, f"{name}_scales")
    tensor_scale = getattr(module, f"{name}_tensor_scale", None)
    if stacked:  # one (codes, scales, tensor scale) per expert
        weights = [(codes[e], scales[e], None if tensor_scale is None else tensor_scale[e]) for e in range(len(codes))]
    else:
        weights = [(codes, scales, tensor_scale)]
    views = []
    for c, s, t in weights:
        s = s.view(torch.float32) if meta["scale_format"] == "fp32" else s
        t = None if t is None else t.view(torch.float32).reshape(())
        views.append(QuantizedTensor(codes=c, scales=s.reshape(meta["scales_shape"]), shape=meta["shape"],
                                     dtype=meta["dtype"], fmt=meta["fmt"], group_size=meta["group_size"],
                                     scale_format=meta["scale_format"], block=meta["block"], tensor_scale=t))
    return views


def install(module: torch.nn.Module, name: str, qts: Sequence[QuantizedTensor], *, stacked: bool,
            compute_dtype: Optional[str], backend: str, activation: Optional[str], transposed: bool = False,
            input_scale: Optional[torch.Tensor] = None) -> None:
    """Replace the parameter ``module.<name>`` (if any) by the buffers of ``qts`` (one weight, or ``stacked``: one per
    expert, all of one layout) and present them to the module's forward (the hooks of the module docstring). The
    caller has checked that the ``qts`` agree; ``activation`` is checked here (W8A8 needs fitting weights).
    ``transposed`` (stacks only): the parameter is ``(E, in, out)`` and each of ``qts`` its expert's ``(out, in)``
    matrix (:class:`~ds_fpquant.linear.weights.QuantizedExperts` ``transposed``). ``input_scale`` (0-dim fp32, finite,
    > 0, with ``activation="e4m3"`` and e4m3 weights with fp32 scales): static per-tensor W8A8 (SPEC 8.3), the buffer
    ``<name>_input_scale``; ``TypeError`` / ``ValueError`` otherwise (:func:`~ds_fpquant.linear.w8a8.check_activation`),
    before ``module`` is changed."""
    for qt in qts[:1] if input_scale is None else qts:  # one layout (caller-checked); static: every weight's format
        check_activation(activation, qt, input_scale)
    module._parameters.pop(name, None)
    register_buffers(module, name, qts, stacked)
    if input_scale is not None:
        module.register_buffer(f"{name}_input_scale", input_scale.detach().clone())
        if not isinstance(module.__dict__.get("_apply"), KeepInputScales):
            module._apply = KeepInputScales(module)
    setattr(module, name, None)
    params = module.__dict__.setdefault(_PARAMS, {})
    params[name] = dict(layout(qts[0]), stacked=stacked, transposed=transposed, backend=backend, activation=activation,
                        compute_dtype=COMPUTE_DTYPES[compute_dtype] if compute_dtype else None,
                        static=input_scale is not None)
    if len(params) == 1:  # one pair of hooks per module, for all its quantized parameters
        module.register_forward_pre_hook(_materialize)
        module.register_forward_hook(_release, always_call=True)
        module.register_load_state_dict_post_hook(_check_loaded_scales)


def input_scale_of(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """The static per-tensor activation scale (0-dim fp32 buffer ``<name>_input_scale``) of the in-place quantized
    parameter ``name`` of ``module``, or ``None`` (weight-only or dynamic W8A8)."""
    meta = quantized_params(module).get(name)
    return getattr(module, f"{name}_input_scale") if meta is not None and meta.get("static") else None


class KeepInputScales:
    """``module._apply`` of a module holding ``<name>_input_scale`` buffers: ``nn.Module._apply`` (what ``.half()``,
    ``.to()``, ``.cuda()`` run), but those buffers keep their fp32 bits under dtype casts; only their device follows.
    A plain object rather than a closure or bound method, so that the module pickles and deep-copies."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, fn, recurse=True):
        module = self.module
        kept = {f"{name}_input_scale": module._buffers[f"{name}_input_scale"]
                for name, meta in quantized_params(module).items() if meta.get("static")}
        result = type(module)._apply(module, fn, recurse)
        for key, scale in kept.items():
            moved = module._buffers[key]
            if moved is not None and moved.dtype != scale.dtype:
                module._buffers[key] = scale.to(moved.device)
        return result


def quantized_params(module: torch.nn.Module) -> Dict[str, Dict]:
    """``{name: meta}`` of the parameters :func:`install` quantized in ``module`` (empty if none)."""
    return getattr(module, _PARAMS, {})


def is_weight_quantized(module: torch.nn.Module) -> bool:
    """Whether ``module.weight`` is a quantized weight installed in place (``quantize_weight_in_place``)."""
    meta = quantized_params(module).get("weight")
    return meta is not None and not meta["stacked"]


def quantized_experts(module: torch.nn.Module) -> Dict[str, List[QuantizedTensor]]:
    """``{parameter name: each expert's QuantizedTensor}`` of the quantized expert stacks of ``module`` (views of its
    buffers; empty if none)."""
    return {name: buffer_views(module, name, meta, True) for name, meta in quantized_params(module).items()
            if meta["stacked"]}


class PerThreadStandIn(DequantizingTensor):
    """``module.<name>`` while forwards of ``module`` run: every use (``F.linear``, ``matmul``, indexing an expert,
    ``.shape``, ``.dtype``, a cast, a dense fallback) is passed to the stand-in of the forward running in the thread
    that uses it (:class:`~ds_fpquant.linear.weights.QuantizedWeight` / ``QuantizedExperts``, built by that forward's
    pre-hook in its own compute dtype). So concurrent forwards of one module, of any dtypes, never see each other's
    stand-in. Used where no forward of the module runs in the thread (kept past its forward), it is a new stand-in
    in the layer's ``compute_dtype`` (else the original weight's dtype). A storage-less tensor subclass; its other
    attributes (``qt``, ``experts``, ...) are the stand-in's."""

    @staticmethod
    def __new__(cls, module: torch.nn.Module, name: str, like: DequantizingTensor):
        self = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                   requires_grad=False)
        self.owner, self.param_name = weakref.ref(module), name
        return self

    def __init__(self, module: torch.nn.Module, name: str, like: DequantizingTensor):
        super().__init__()

    def resolve(self) -> DequantizingTensor:
        """The stand-in of the innermost forward of the module running in this thread (else a new one, as the class
        docstring says)."""
        module = self.owner()
        stack = _in_flight_stand_ins().get((id(module), self.param_name))
        if stack:
            return stack[-1]
        if module is None:
            raise RuntimeError(f"the module of the quantized parameter {self.param_name!r} no longer exists")
        return _stand_in(module, self.param_name, quantized_params(module)[self.param_name], None)

    def __getattr__(self, name):
        if name in ("owner", "param_name"):  # not set yet (construction)
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __repr__(self, *, tensor_contents=None):
        return repr(self.resolve())

    def dequantized(self) -> torch.Tensor:
        return self.resolve().dequantized()

    def numerics(self) -> str:
        return self.resolve().numerics()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def own(value):
            return value.resolve() if isinstance(value, PerThreadStandIn) else value

        args, kwargs = torch.utils._pytree.tree_map(own, (args, kwargs or {}))
        return func(*args, **kwargs)


#: Per thread: ``{(id(module), name): [stand-in of each forward of the module running in this thread]}``.
_THREAD = threading.local()
#: Forwards running per module (all threads), and the lock that guards the counts and the presented attributes.
_RUNNING: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _in_flight_stand_ins() -> Dict:
    stacks = getattr(_THREAD, "stacks", None)
    if stacks is None:
        stacks = _THREAD.stacks = {}
    return stacks


def _stand_in(module: torch.nn.Module, name: str, meta: Dict, x: Optional[torch.Tensor]) -> DequantizingTensor:
    """A new stand-in for ``module.<name>`` (views of its buffers) in the compute dtype of a forward on ``x``."""
    dtype = meta["compute_dtype"] or (x.dtype if x is not None else meta["dtype"])
    views = buffer_views(module, name, meta, meta["stacked"])
    scale = input_scale_of(module, name)
    if meta["stacked"]:
        return QuantizedExperts(views, dtype, meta["backend"], meta["activation"], meta.get("transposed", False),
                                input_scale=scale)
    return QuantizedWeight(views[0], dtype, meta["backend"], activation=meta["activation"], input_scale=scale)


def dequantize_in_place(module: torch.nn.Module, name: str, dtype: Optional[torch.dtype] = None) -> None:
    """Undo :func:`install` for ``module.<name>``: the parameter again (``requires_grad=False``), holding the
    dequantized weight (SPEC 5) in ``dtype`` (default: the dtype it was quantized from); a stack as the module's 3-D
    ``(E, out, in)`` parameter (``(E, in, out)`` for transposed experts). The buffers are dropped; the module's hooks
    find nothing left to present."""
    meta = quantized_params(module).pop(name)
    views = buffer_views(module, name, meta, meta["stacked"])
    dtype = dtype or meta["dtype"]
    weights = [qt.dequantize(dtype, backend=meta["backend"]) for qt in views]
    weight = torch.stack([w.t() if meta.get("transposed") else w for w in weights]) if meta["stacked"] else weights[0]
    for suffix in ("codes", "scales", "tensor_scale", "input_scale"):
        module._buffers.pop(f"{name}_{suffix}", None)
    module.__dict__.pop(name, None)
    module._parameters[name] = torch.nn.Parameter(weight, requires_grad=False)


# The hooks of install: module-level functions (not closures), so that a module holding them pickles (torch.save
# of a whole model) and deep-copies.
def _materialize(module, args):
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    weights = {name: _stand_in(module, name, meta, x) for name, meta in quantized_params(module).items()}
    if torch.compiler.is_compiling():  # traced: the stand-in is built in the graph, no per-thread state
        for name, weight in weights.items():
            setattr(module, name, weight)
        return
    stacks = _in_flight_stand_ins()
    for name, weight in weights.items():
        stacks.setdefault((id(module), name), []).append(weight)
    with _LOCK:
        _RUNNING[module] = _RUNNING.get(module, 0) + 1
        for name, weight in weights.items():
            if not isinstance(module.__dict__.get(name), PerThreadStandIn):  # the first forward running
                setattr(module, name, PerThreadStandIn(module, name, weight))


def _release(module, args, output):
    if torch.compiler.is_compiling():
        for name in quantized_params(module):
            setattr(module, name, None)
        return
    stacks, ran = _in_flight_stand_ins(), False
    for name in quantized_params(module):
        stack = stacks.get((id(module), name))
        if stack:
            stack.pop()
            ran = True
            if not stack:
                del stacks[(id(module), name)]
    if not ran:  # an earlier pre-hook raised before this forward's stand-ins were made: nothing to release
        return
    with _LOCK:
        running = _RUNNING.pop(module, 0) - 1
        if running > 0:
            _RUNNING[module] = running
        else:  # the last forward running: nothing presented between forwards
            for name in quantized_params(module):
                setattr(module, name, None)


def _check_loaded_scales(module, incompatible_keys):
    """After ``load_state_dict``: each static input scale checked as :func:`install` checks it."""
    for name in quantized_params(module):
        scale = input_scale_of(module, name)
        if scale is not None:
            check_input_scale(scale)
