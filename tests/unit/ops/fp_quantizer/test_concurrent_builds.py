"""JIT builds under concurrency and failure: N processes build one op once and all load it; a build
killed half way is recovered by the next load; a failing build gives one clear error and the
torch fallback, never a hang."""

import os
import signal
import subprocess
import sys
import time

LOAD = ("import torch, ds_fpquant as fpq; from ds_fpquant.ops.backends import load_op; m, why = load_op('cpu'); "
        "assert m is not None, why; x = torch.randn(8, 64); "
        "assert torch.equal(fpq.quantize(x, 'e2m1', 32, backend='cpu').codes, "
        "fpq.quantize(x, 'e2m1', 32, backend='torch').codes); print(m.__file__)")


def _env(ext_dir, **extra):
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), **extra)


def test_concurrent_jit_builds(tmp_path, processes=4):
    """4 processes (more than the cores CI has) race for one build: it runs once, every process loads it."""
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    files = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(files) == 1, files  # one module, built once
    announced = sum("building the ds_fpquant_cpu op" in err for _, err in outs)
    assert announced >= 1
    # a later process loads the cached build: no announcement, the module file untouched
    (module,) = files
    mtime = os.stat(module).st_mtime_ns
    again = subprocess.run([sys.executable, "-c", LOAD], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == module and "building the" not in again.stderr
    assert os.stat(module).st_mtime_ns == mtime


def test_killed_build_is_recovered(tmp_path):
    build = subprocess.Popen([sys.executable, "-c", LOAD], env=_env(tmp_path), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (locks := list(tmp_path.glob("ds_fpquant_cpu_*/lock"))) and time.time() < deadline \
            and build.poll() is None:
        time.sleep(0.2)
    assert locks, "the build never took torch's lock"
    (lock,) = locks
    time.sleep(2)  # let the compiler start
    os.killpg(build.pid, signal.SIGKILL)
    build.wait()
    assert lock.exists(), "a killed build leaves torch's lock file behind"
    again = subprocess.run([sys.executable, "-c", LOAD], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]


def test_failing_build_falls_back_with_one_warning(tmp_path):
    probe = ("import warnings, torch, ds_fpquant as fpq\n"
             "with warnings.catch_warnings(record=True) as w:\n"
             "    warnings.simplefilter('always')\n"
             "    fpq.quantize(torch.randn(4, 8), 'e4m3', 8); fpq.quantize(torch.randn(4, 8), 'e4m3', 8)\n"
             "print(len(w), w[0].message if w else '')\n"
             "try:\n"
             "    fpq.quantize(torch.randn(4, 8), 'e4m3', 8, backend='cpu')\n"
             "except RuntimeError as e:\n"
             "    print('explicit:', e)\n")
    run = subprocess.run([sys.executable, "-c", probe], env=_env(tmp_path, CXX="false"), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    first, explicit = run.stdout.strip().splitlines()[-2:]
    assert first.startswith("1 ds_fpquant: using the torch backend for cpu tensors:"), first
    assert explicit.startswith("explicit: backend='cpu': the compiled op is not available:"), explicit
