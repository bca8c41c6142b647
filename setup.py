"""Install ds_fpquant like DeepSpeed installs itself.

``op_builder/`` is installed as ``ds_fpquant.op_builder`` and ``csrc/`` ships as package data
(``ds_fpquant.csrc``), the way DeepSpeed's setup.py maps its ``op_builder`` and ``csrc``; the
builders JIT-compile the sources from the installed package on first use.

Like DeepSpeed's ``DS_BUILD_*`` variables, ``DS_BUILD_FPQUANT=1`` (CUDA op) and
``DS_BUILD_FPQUANT_CPU=1`` (CPU op) prebuild the ops at install time; torch and DeepSpeed must
then already be installed: ``DS_BUILD_FPQUANT_CPU=1 pip install --no-build-isolation .``
"""

import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def prebuilt_extensions():
    """Extensions for the ops whose DS_BUILD_* variable is 1, built by torch's BuildExtension."""
    wanted = {name: os.environ.get(name, "0") == "1" for name in ("DS_BUILD_FPQUANT", "DS_BUILD_FPQUANT_CPU")}
    if not any(wanted.values()):
        return [], {}
    sys.path.insert(0, HERE)  # the builders, before the package is installed
    from torch.utils.cpp_extension import BuildExtension

    from op_builder.fp_quantizer import FPQuantizerBuilder
    from op_builder.fp_quantizer_cpu import FPQuantizerCPUBuilder

    extensions = []
    for builder in (FPQuantizerBuilder(), FPQuantizerCPUBuilder()):
        if not wanted[builder.BUILD_VAR]:
            continue
        if not builder.is_compatible(verbose=True):
            raise SystemExit(f"{builder.BUILD_VAR}=1 but {builder.NAME} cannot be built here: {builder.error_log}")
        ext = builder.builder()
        ext.sources = [os.path.relpath(s, HERE) for s in ext.sources]
        extensions.append(ext)
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = prebuilt_extensions()

setup(
    packages=[*find_packages(include=["ds_fpquant", "ds_fpquant.*"]), "ds_fpquant.op_builder", "ds_fpquant.csrc"],
    package_dir={
        "ds_fpquant": "ds_fpquant",
        "ds_fpquant.op_builder": "op_builder",
        "ds_fpquant.csrc": "csrc",
    },
    package_data={"ds_fpquant.csrc": ["**/*.h", "**/*.cuh", "**/*.cu", "**/*.cpp"]},
    include_package_data=False,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
