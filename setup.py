"""Install ds_fpquant like DeepSpeed installs itself.

``op_builder/`` is installed as ``ds_fpquant.op_builder`` and ``csrc/`` ships as package data
(``ds_fpquant.csrc``), the way DeepSpeed's setup.py maps its ``op_builder`` and ``csrc``; the
builders JIT-compile the sources from the installed package on first use.
"""

from setuptools import setup

setup(
    packages=["ds_fpquant", "ds_fpquant.op_builder", "ds_fpquant.csrc"],
    package_dir={
        "ds_fpquant": "ds_fpquant",
        "ds_fpquant.op_builder": "op_builder",
        "ds_fpquant.csrc": "csrc",
    },
    package_data={"ds_fpquant.csrc": ["**/*.h", "**/*.cuh", "**/*.cu", "**/*.cpp"]},
    include_package_data=False,
)
