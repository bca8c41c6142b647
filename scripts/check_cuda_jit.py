"""JIT-build the CUDA op through ``FPQuantizerBuilder().load()`` in a CUDA torch, without a GPU.

Run with the python of an environment that has a CUDA build of torch (CI: torch 2.14.1+cu130),
DeepSpeed and this project. It checks what can be checked without a GPU:

- the builder reports itself compatible and builds through DeepSpeed's ``jit_load`` even though
  ``jit_load`` sets ``build_for_cpu`` (no GPU visible): nvcc flags kept, sm_90 targeted;
- the module imports, says it has CUDA, and its C++ format table equals ``formats.py``;
- the built module's SASS has the hardware fp8 conversions (``F2FP ... E4M3`` / ``E5M2``);
- its CPU kernels give the torch reference's bits.

Prints one JSON object; exit status 0 when every check passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main() -> int:
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    import torch

    from ds_fpquant.cli.report import self_test
    from ds_fpquant.numerics.formats import traits_table
    from ds_fpquant.op_builder.builder import cuda_tool
    from ds_fpquant.op_builder.fp_quantizer import FPQuantizerBuilder

    result = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpu": torch.cuda.is_available()}
    if torch.version.cuda is None:  # a CPU build of torch builds no CUDA op: fail at once (gpu_check's stand-in)
        print(json.dumps({**result, "ok": False, "error": "torch is a CPU build (torch.version.cuda is None)"}))
        return 1
    builder = FPQuantizerBuilder()
    result["compatible"] = builder.is_compatible(verbose=True)
    result["incompatible_reason"] = builder.error_log
    start = time.time()
    module = builder.load(verbose=False)
    result["build_s"] = round(time.time() - start, 1)
    result["module"] = module.__file__
    result["with_cuda"] = bool(module.WITH_CUDA)

    cpp_table, py_table = module.format_table(), traits_table()
    mismatches = [] if cpp_table == py_table else [{"cpp": cpp_table, "python": py_table}]
    result["format_table_mismatches"] = mismatches

    cuda_tool("nvdisasm")
    sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", module.__file__], capture_output=True, text=True,
                          check=True).stdout
    result["sass_arches"] = sorted(set(line.split()[-1] for line in sass.splitlines() if "arch = " in line))
    result["f2fp_e4m3"] = sass.count("F2FP.SATFINITE.E4M3")
    result["f2fp_e5m2"] = sass.count("F2FP.SATFINITE.E5M2")
    result["local_memory_ops"] = sum(1 for line in sass.splitlines() if " LDL" in line or " STL" in line)

    passed, detail = self_test(module, "cpu")  # its CPU kernels vs the torch reference, bit for bit
    result["cpu_kernels"] = detail
    bad = [] if passed else [detail]

    ok = (result["compatible"] and result["with_cuda"] and not mismatches and result["f2fp_e4m3"] > 0
          and result["f2fp_e5m2"] > 0 and result["local_memory_ops"] == 0 and not bad
          and any("sm_90" in a for a in result["sass_arches"]))
    result["ok"] = bool(ok)
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
