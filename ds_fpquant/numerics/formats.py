"""The element-format table (SPEC 1): the only place format facts live.

Each format is defined by its exponent width, mantissa width and its rule for the top exponent
code; everything else (bias, max finite, min normal, min subnormal, NaN/Inf codes) is derived.
The C++ codec header mirrors this table as traits, and a test checks the two agree.

Sources: OCP 8-bit Floating Point Specification (OFP8) rev 1.0 (e4m3, e5m2); OCP Microscaling
Formats (MX) v1.0 (e3m2, e2m3, e2m1, E8M0). ``e4m7`` has no standard; it exists only so
DeepSpeed's ``q_bits=12`` keeps working, and all its exponent codes are finite.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, Optional, Tuple

import torch


class TopCode(enum.Enum):
    """What the all-ones exponent code means."""

    #: IEEE-like: all-ones exponent is Inf (mantissa 0) or NaN (any other mantissa). e5m2.
    IEEE = "ieee"
    #: "fn" (finite + NaN): only S.1..1.1..1 is NaN, the rest of the top binade is finite. e4m3.
    NAN_ONLY_ALL_ONES = "nan_only_all_ones"
    #: "fn" with no NaN at all: every code is finite. FP6, FP4 and e4m7.
    FINITE = "finite"


@dataclass(frozen=True)
class FPFormat:
    """One element format: ``1`` sign bit, ``ebits`` exponent bits, ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    top: TopCode

    # ---- derived facts (SPEC 1) -------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Bits per code: 8, 6, 4 or 12."""
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        """Exponent bias ``2^(ebits-1) - 1``."""
        return (1 << (self.ebits - 1)) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal: ``1 - bias``."""
        return 1 - self.bias

    @property
    def max_biased_exp(self) -> int:
        """Largest exponent code that holds finite values."""
        all_ones = (1 << self.ebits) - 1
        return all_ones - 1 if self.top is TopCode.IEEE else all_ones

    @property
    def max_mantissa_at_top(self) -> int:
        """Largest mantissa code of the largest finite binade."""
        all_ones = (1 << self.mbits) - 1
        return all_ones - 1 if self.top is TopCode.NAN_ONLY_ALL_ONES else all_ones

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade (``floor(log2(fmax))``)."""
        return self.max_biased_exp - self.bias

    @property
    def max_code(self) -> int:
        """Code (sign 0) of the largest finite magnitude."""
        return (self.max_biased_exp << self.mbits) | self.max_mantissa_at_top

    @property
    def fmax(self) -> float:
        """Largest finite value, e.g. ``1.75 * 2^8 = 448`` for e4m3."""
        return (1.0 + self.max_mantissa_at_top / (1 << self.mbits)) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        """Smallest positive normal ``2^emin``."""
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal ``2^(emin - mbits)``."""
        return 2.0 ** (self.emin - self.mbits)

    @property
    def has_inf(self) -> bool:
        return self.top is TopCode.IEEE

    @property
    def has_nan(self) -> bool:
        return self.top is not TopCode.FINITE

    @property
    def sign_bit(self) -> int:
        """The sign bit of a code, ``1 << (bits - 1)``."""
        return 1 << (self.bits - 1)

    @property
    def nan_code(self) -> Optional[int]:
        """The NaN code written for NaN input (sign 0), SPEC 3.3: all ones below the sign."""
        return self.sign_bit - 1 if self.has_nan else None

    @property
    def inf_code(self) -> Optional[int]:
        """The +Inf code (sign 0), or ``None`` when the format has no Inf."""
        return ((1 << self.ebits) - 1) << self.mbits if self.has_inf else None

    @cached_property
    def decode_table(self) -> Tuple[float, ...]:
        """Value of every code ``0 .. 2^bits - 1`` as a Python float (exact; NaN for NaN codes)."""
        return tuple(_decode_code(self, code) for code in range(1 << self.bits))


def _decode_code(f: FPFormat, code: int) -> float:
    """Exact value of one code (SPEC 1 and 5)."""
    sign = -1.0 if code & f.sign_bit else 1.0
    exp_code = (code >> f.mbits) & ((1 << f.ebits) - 1)
    man = code & ((1 << f.mbits) - 1)
    all_ones_exp = exp_code == (1 << f.ebits) - 1
    if f.top is TopCode.IEEE and all_ones_exp:
        return sign * math.inf if man == 0 else math.nan
    if f.top is TopCode.NAN_ONLY_ALL_ONES and all_ones_exp and man == (1 << f.mbits) - 1:
        return math.nan
    if exp_code == 0:  # subnormal: 0.man * 2^emin
        return sign * man * 2.0 ** (f.emin - f.mbits)
    return sign * (1.0 + man / (1 << f.mbits)) * 2.0 ** (exp_code - f.bias)


#: The table of SPEC 1. Nothing else in the project types a maximum or a bias.
FORMATS: Dict[str, FPFormat] = {
    f.name: f
    for f in (
        FPFormat("e4m3", 4, 3, TopCode.NAN_ONLY_ALL_ONES),  # max 1.75 * 2^8  = 448
        FPFormat("e5m2", 5, 2, TopCode.IEEE),  # max 1.75 * 2^15 = 57344
        FPFormat("e3m2", 3, 2, TopCode.FINITE),  # max 1.75 * 2^4  = 28
        FPFormat("e2m3", 2, 3, TopCode.FINITE),  # max 1.875 * 2^2 = 7.5
        FPFormat("e2m1", 2, 1, TopCode.FINITE),  # max 1.5 * 2^2   = 6
        FPFormat("e4m7", 4, 7, TopCode.FINITE),  # max (2 - 2^-7) * 2^8 = 510
    )
}


#: DeepSpeed's ``(q_bits, q_mantisa_bits)`` spelling (SPEC 1). ``e2m3`` has none.
DEEPSPEED_FORMATS: Dict[Tuple[int, int], str] = {
    (8, 3): "e4m3",
    (8, 2): "e5m2",
    (6, 2): "e3m2",
    (4, 1): "e2m1",
    (12, 7): "e4m7",
}


#: ``q_mantisa_bits`` default of DeepSpeed's ``FP_Quantize`` methods and ``QuantizationConfig.mantissa_bits``.
DEEPSPEED_DEFAULT_MANTISSA_BITS = 3


#: ``q_bits`` for which DeepSpeed ignores ``q_mantisa_bits`` and uses its fixed fp12 / fp6 / fp4
#: (``deepspeed/ops/fp_quantizer/quantize.py``); only 8 bits choose between two formats.
DEEPSPEED_FIXED_FORMATS: Dict[int, str] = {b: n for (b, _), n in DEEPSPEED_FORMATS.items() if b != 8}


def traits_table() -> Dict[str, Dict[str, Any]]:
    """The format table in the shape of the C++ op's ``format_table()`` (fp_codec.h traits), so
    a test can check that the two definitions agree (SPEC 1). Formats without NaN/Inf report the
    code the codec writes for them (0)."""
    table = {}
    for name, f in FORMATS.items():
        nan = f.nan_code if f.has_nan else 0
        table[name] = dict(ebits=f.ebits, mbits=f.mbits, bits=f.bits, bias=f.bias, emax=f.emax, fmax=f.fmax,
                           min_normal=f.min_normal, min_subnormal=f.min_subnormal, has_inf=f.has_inf,
                           has_nan=f.has_nan, max_code=f.max_code, nan_code=nan,
                           inf_code=f.inf_code if f.has_inf else nan)
    return table


def get_format(fmt) -> FPFormat:
    """Look up a format by name (``"e4m3"``, ...) or pass an :class:`FPFormat` through.

    Raises:
        TypeError: ``fmt`` is neither a string nor an ``FPFormat``.
        ValueError: unknown name; the message lists the supported formats.
    """
    if isinstance(fmt, FPFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a str, got {type(fmt).__name__} ({fmt!r}); "
                        f"allowed: {', '.join(FORMATS)}")
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"fmt={fmt!r} is not supported; allowed: {', '.join(FORMATS)}") from None


def format_from_deepspeed(q_bits, q_mantisa_bits) -> FPFormat:
    """Map DeepSpeed's ``(q_bits, q_mantisa_bits)`` to a format (SPEC 1), or raise.

    ``q_bits=8`` chooses by ``q_mantisa_bits``: 3 is ``e4m3``, 2 is ``e5m2``. For ``q_bits`` 12, 6 and 4
    DeepSpeed's ``FP_Quantize`` ignores ``q_mantisa_bits`` (its default is 3) and uses its fp12 / fp6 /
    fp4, which are ``e4m7``, ``e3m2`` and ``e2m1`` here; so these accept DeepSpeed's default 3 or the
    format's own mantissa bits (7, 2, 1). Any other pair is an error, never re-dispatched.

    Raises:
        TypeError: ``q_bits`` or ``q_mantisa_bits`` is not an int.
        ValueError: a pair that names no format; the message lists the allowed pairs.
    """
    for name, value in (("q_bits", q_bits), ("q_mantisa_bits", q_mantisa_bits)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if (q_bits, q_mantisa_bits) in DEEPSPEED_FORMATS:
        return FORMATS[DEEPSPEED_FORMATS[(q_bits, q_mantisa_bits)]]
    if q_bits in DEEPSPEED_FIXED_FORMATS and q_mantisa_bits == DEEPSPEED_DEFAULT_MANTISSA_BITS:
        return FORMATS[DEEPSPEED_FIXED_FORMATS[q_bits]]
    allowed = [f"({b}, {m}) or ({b}, {DEEPSPEED_DEFAULT_MANTISSA_BITS}) {n}" if b in DEEPSPEED_FIXED_FORMATS
               else f"({b}, {m}) {n}" for (b, m), n in DEEPSPEED_FORMATS.items()]
    raise ValueError(f"(q_bits, q_mantisa_bits)=({q_bits}, {q_mantisa_bits}) is not supported; allowed: "
                     f"{', '.join(allowed)} (for q_bits 12, 6, 4 the mantissa bits are DeepSpeed's default "
                     f"{DEEPSPEED_DEFAULT_MANTISSA_BITS} or the format's own)")


#: Named presets of docs/api.md: element format, group size, scale format. The MX presets have E8M0 scales
#: (OCP MX v1.0, SPEC 3.2); NVFP4 has e4m3 group scale codes times a per-tensor fp32 scale (SPEC 3.4).
PRESETS: Dict[str, Tuple[str, int, str]] = {
    "mxfp8_e4m3": ("e4m3", 32, "e8m0"),
    "mxfp8_e5m2": ("e5m2", 32, "e8m0"),
    "mxfp6_e3m2": ("e3m2", 32, "e8m0"),
    "mxfp6_e2m3": ("e2m3", 32, "e8m0"),
    "mxfp4": ("e2m1", 32, "e8m0"),
    "nvfp4": ("e2m1", 16, "e4m3"),
}


#: NVFP4's element format and the format of its group scale codes (SPEC 3.4), from its preset.
NVFP4_ELEMENT_FORMAT, _, NVFP4_SCALE_FORMAT = PRESETS["nvfp4"]


#: ``group_size`` and ``scale_format`` of an element format when the caller gives none (docs/api.md).
DEFAULT_GROUP_SIZE = 128


DEFAULT_SCALE_FORMAT = "fp32"


def resolve_preset(fmt, group_size: Optional[int] = None, scale_format: Optional[str] = None) -> Tuple[int, str]:
    """``(group_size, scale_format)`` for ``fmt``; the one place where "not given" (``None``) is resolved.

    A preset fixes both (:data:`PRESETS`: G=32 and ``"e8m0"`` for MX, OCP MX v1.0; G=16 and ``"e4m3"``
    for NVFP4, SPEC 3.4): ``None`` takes the preset's value, a given value must equal it. An element
    format takes :data:`DEFAULT_GROUP_SIZE` / :data:`DEFAULT_SCALE_FORMAT` for ``None`` and any given
    value as it is (checked by the caller). ``fmt`` itself is not checked here.

    Raises:
        TypeError: ``group_size`` is not an int.
        ValueError: ``group_size < 1``, or a given value that differs from the preset's.
    """
    from ds_fpquant.numerics.checks import check_int

    if group_size is not None:
        group_size = check_int("group_size", group_size, 1)
    if scale_format is not None and not isinstance(scale_format, str):
        raise TypeError(f"scale_format must be a str, got {type(scale_format).__name__} ({scale_format!r})")
    if not (isinstance(fmt, str) and fmt in PRESETS):
        return (DEFAULT_GROUP_SIZE if group_size is None else group_size,
                DEFAULT_SCALE_FORMAT if scale_format is None else scale_format)
    _, preset_g, preset_scales = PRESETS[fmt]
    if group_size is not None and group_size != preset_g:
        raise ValueError(f"fmt={fmt!r} fixes group_size={preset_g}; got group_size={group_size} (leave it out, "
                         f"or use the element format {PRESETS[fmt][0]!r} for other group sizes)")
    if scale_format is not None and scale_format != preset_scales:
        raise ValueError(f"fmt={fmt!r} fixes scale_format={preset_scales!r}; got scale_format={scale_format!r} "
                         f"(leave it out, or use the element format {PRESETS[fmt][0]!r} for other scales)")
    return preset_g, preset_scales


def resolve_scaling(fmt, group_size: Optional[int] = None, block: Optional[Tuple[int, int]] = None,
                    scale_format: Optional[str] = None) -> Tuple[int, str, Optional[Tuple[int, int]]]:
    r"""The one resolution of the scaling arguments of a quantize call, a config section or a checkpoint run:
    ``(group_size, scale_format, block)`` with a preset's own values (:func:`resolve_preset`) and, with 2-D
    ``block``\ s ``(Br, Bc)``, ``Bc`` as the group size (SPEC 2, 6). ``block`` is a pair of ints >= 1 already
    (the callers check its type); ``fmt`` and the scale format's value are checked by the callers too.

    Raises:
        TypeError: ``group_size`` is not an int.
        ValueError: a ``group_size`` other than ``Bc`` with ``block``; a preset with ``block`` (a preset fixes
            its groups along the last dim); a preset's ``group_size`` / ``scale_format`` given otherwise.
    """
    from .checks import check_int

    if block is not None:
        block = (block[0], block[1])
        if group_size is not None and check_int("group_size", group_size, 1) != block[1]:
            raise ValueError(f"block={block!r} fixes the groups to Bc={block[1]} codes; got group_size={group_size} "
                             f"(leave group_size out with block)")
    group_size, scale_format = resolve_preset(fmt, group_size, scale_format)
    if isinstance(fmt, str) and fmt in PRESETS and block is not None:
        source = "SPEC 3.4" if fmt == "nvfp4" else "OCP MX v1.0"
        raise ValueError(f"fmt={fmt!r} fixes groups of {PRESETS[fmt][1]} along the last dim ({source}); "
                         f"block={block!r} cannot be combined with it")
    return (block[1] if block is not None else group_size), scale_format, block


#: ``granularity=`` (SPEC 2): one scale per matrix, or one per row (output channel); listed in
#: :mod:`ds_fpquant.numerics.choices` with the other choices.
GRANULARITIES = ("tensor", "channel")


#: The block / group side that ``granularity`` records: a side at least the matrix side means the whole side
#: (SPEC 2), and ``2^31 - 1`` (INT32_MAX) is at least every side, so layers of any shape share one setting.
WHOLE = 2**31 - 1


def resolve_granularity(fmt, granularity: Optional[str], group_size: Optional[int] = None,
                        block: Optional[Tuple[int, int]] = None) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    """``(group_size, block)`` for ``granularity`` (SPEC 2): ``"tensor"`` is ``block=(WHOLE, WHOLE)`` (one scale per
    2-D matrix, scales ``(1, 1)``), ``"channel"`` is ``group_size=WHOLE`` (one scale per row, scales ``(N, 1)``);
    ``None`` returns ``group_size`` and ``block`` as given.

    Raises:
        TypeError: ``granularity`` is not a str.
        ValueError: ``granularity`` is not ``"tensor"`` / ``"channel"``, or is combined with ``group_size``,
            ``block`` or a preset ``fmt`` (which fixes its own groups).
    """
    if granularity is None:
        return group_size, block
    from .checks import check_choice

    check_choice("granularity", granularity, GRANULARITIES)
    given = [f"{name}={value!r}" for name, value in (("group_size", group_size), ("block", block)) if value is not None]
    if given:
        raise ValueError(f"granularity={granularity!r} sets the scaling itself; it cannot be combined with "
                         f"{', '.join(given)} (give one of granularity, group_size, block)")
    if isinstance(fmt, str) and fmt in PRESETS:
        raise ValueError(f"fmt={fmt!r} fixes groups of {PRESETS[fmt][1]} along the last dim; granularity="
                         f"{granularity!r} cannot be combined with it")
    return (None, (WHOLE, WHOLE)) if granularity == "tensor" else (WHOLE, None)


#: W8A8 (``activation="e4m3"``): activations in groups of 128 per token, weights in 1x128 groups or 128x128 blocks.
W8A8_GROUP = 128


def w8a8_weight_problem(fmt: str, scale_format: str, group_size: int, block) -> Optional[str]:
    """Why a weight quantized with these settings cannot take the W8A8 path (the blockwise FP8 GEMM wants
    e4m3 codes with fp32 scales in 1x128 groups or 128x128 blocks), or ``None`` when it can."""
    block = None if block is None else tuple(block)
    layout_ok = block == (W8A8_GROUP, W8A8_GROUP) or (block is None and group_size == W8A8_GROUP)
    if fmt == "e4m3" and scale_format == "fp32" and layout_ok:
        return None
    return (f"activation='e4m3' (W8A8) needs e4m3 weights with fp32 scales in groups of 128 or (128, 128) "
            f"blocks; got fmt={fmt!r}, group_size={group_size}, block={block}, scale_format={scale_format!r}")


def element_format(fmt) -> FPFormat:
    """The element format of ``fmt``: a format name, or a preset's element format (docs/api.md).

    Raises:
        TypeError, ValueError: ``fmt`` is not a str, or names neither a format nor a preset.
    """
    if isinstance(fmt, str) and fmt in PRESETS:
        return get_format(PRESETS[fmt][0])
    if isinstance(fmt, FPFormat) or (isinstance(fmt, str) and fmt in FORMATS):
        return get_format(fmt)
    allowed = ", ".join([*FORMATS, *PRESETS])
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a str, got {type(fmt).__name__} ({fmt!r}); allowed: {allowed}")
    raise ValueError(f"fmt={fmt!r} is not supported; allowed: {allowed}")


#: torch's own dtypes of the 8-bit element formats: ``qt.codes.view(FP8_DTYPES[fmt])`` is valid (SPEC 6).
FP8_DTYPES: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
