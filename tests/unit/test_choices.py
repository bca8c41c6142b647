"""Issue 17: each choice list is defined once (``ds_fpquant.choices``); the command line, the pydantic
config and the API checks offer exactly those values."""

import typing

import pytest

import ds_fpquant as fpq
from ds_fpquant.cli.quantize import quantize_parser
from ds_fpquant.config import FPQuantizationConfig
from ds_fpquant.numerics import choices
from ds_fpquant.numerics.formats import FORMATS, PRESETS
from ds_fpquant.tensor.quantize import check_settings


def _cli_choices():
    return {action.dest: list(action.choices) for action in quantize_parser()._actions if action.choices}


def test_cli_choices_are_the_library_choices():
    assert _cli_choices() == {"fmt": [*FORMATS, *PRESETS], "scale_format": list(choices.ALL_SCALE_FORMATS),
                              "backend": list(choices.BACKENDS), "granularity": list(choices.GRANULARITIES),
                              "layout": list(choices.LAYOUTS)}


@pytest.mark.parametrize("field,values", [("backend", choices.BACKENDS), ("scale_format", choices.ALL_SCALE_FORMATS),
                                          ("rounding", choices.ROUNDINGS),
                                          ("compute_dtype", choices.COMPUTE_DTYPE_NAMES),
                                          ("activation", choices.ACTIVATIONS),
                                          ("granularity", choices.GRANULARITIES)])
def test_config_fields_take_the_library_choices(field, values):
    annotation = FPQuantizationConfig.model_fields[field].annotation
    candidates = (annotation,) if typing.get_origin(annotation) is typing.Literal else typing.get_args(annotation)
    literal = next(a for a in candidates if typing.get_origin(a) is typing.Literal)
    assert typing.get_args(literal) == tuple(values)


def test_check_settings_resolves_as_quantize_does():
    import torch

    x = torch.randn(4, 64)
    for fmt, group_size, block, scale_format in [("e4m3", None, None, None), ("mxfp4", None, None, None),
                                                  ("nvfp4", None, None, None), ("e2m1", None, (2, 32), "e8m0")]:
        qt = fpq.quantize(x, fmt, group_size, block=block, scale_format=scale_format)
        assert check_settings(fmt, group_size, block=block, scale_format=scale_format) == (
            qt.group_size, qt.scale_format, qt.block)
        assert qt.validate() is qt
    with pytest.raises(ValueError, match="rounding='sometimes' is not supported"):
        check_settings("e4m3", rounding="sometimes")
