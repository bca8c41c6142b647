"""scripts/gpu_check.sh, the one prepared check for a lent GPU, checked without one (issue 42): a dry run on a stand-in
(no CUDA device: the GPU steps fail at once) leaves one archive that unpacks, with every step's log, and a summary that
names every step, at most 8 files in $OUT, and the global deadline cuts a step that sleeps past it and skips the
rest; scripts/bench_linear_cuda.py refuses a layer count whose smallest quantized pass is under 4x the L2 it is told,
sizes its passes from the same bytes ``QuantizedTensor.nbytes`` counts, and refuses bad arguments by name."""

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from ds_fpquant import quantize

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ["environment", "install", "build", "tests", "memcheck", "racecheck", "synccheck", "extra", "bench"]
DEADLINE_S = 30


def _bench():
    spec = importlib.util.spec_from_file_location("bench_linear_cuda", REPO / "scripts" / "bench_linear_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_parses():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_gpu_check_dry_run_one_archive_within_the_deadline(tmp_path):
    missing = [tool for tool in ("bash", "timeout", "flock", "tar") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {missing}")
    out = tmp_path / "out"
    out.mkdir()
    # the stand-in: this python, no CUDA device; the project is installed already, a CUDA torch's build step would
    # take minutes (a CPU torch fails it at once, which the run keeps), and the environment probe is left out so that
    # a loaded machine still reaches the sleeping step well before the deadline
    skip = "install environment" + (" build" if torch.version.cuda else "")
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_PY": sys.executable, "GPU_CHECK_SKIP": skip,
           "GPU_CHECK_DEADLINE_S": str(DEADLINE_S), "GPU_CHECK_MIN_STEP_S": "1", "GPU_CHECK_EXTRA": "sleep 600",
           "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    start = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=DEADLINE_S + 60)
    wall = time.monotonic() - start
    assert run.returncode == 1, run.stdout + run.stderr  # steps failed (no device), so the script says so
    assert wall < DEADLINE_S + 20, f"{wall:.0f} s for a deadline of {DEADLINE_S} s"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tgz", "summary.txt"]  # the tool returns <= 8

    summary = (out / "summary.txt").read_text()
    lines = dict(re.findall(r"^(\w+): (.*)$", summary, re.M))
    assert [s for s in STEPS if s not in lines] == [], summary
    assert lines["install"] == lines["environment"] == "skipped (GPU_CHECK_SKIP)", summary
    for name in ("tests", "memcheck", "racecheck", "synccheck"):
        assert lines[name].startswith("rc=3,"), summary  # no CUDA device: failed at once
    assert re.match(r"rc=124, \d+ s, limit \d+ s \(the deadline\)$", lines["extra"]), summary
    assert lines["bench"].startswith("skipped by the deadline"), summary

    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        packed = tar.extractfile(next(m for m in tar.getmembers() if Path(m.name).name == "summary.txt")).read()
    ran = [s for s in STEPS if lines[s].startswith("rc=")]
    assert {f"{s}.log" for s in ran} <= names, (names, summary)
    assert packed.decode() == summary
    assert "no CUDA device" in _member_text(out / "gpu_check.tgz", "tests.log")
    assert list(tmp_path.glob("gpu_check.*")) == []  # the work folder is removed


def _member_text(archive: Path, name: str) -> str:
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if Path(m.name).name == name)
        return io.TextIOWrapper(tar.extractfile(member)).read()


def test_bench_refuses_a_pass_under_4x_l2(capsys):
    bench = _bench()
    l2 = 60 * 2**20  # the H200's L2 as PyTorch reports it
    need = bench.layers_for(4096, 4096, bench.FORMATS, l2)
    smallest = min(bench.layer_bytes(4096, 4096, f) for f in bench.FORMATS)
    assert need * smallest >= 4 * l2 > (need - 1) * smallest
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "4096x4096", "--layers", str(need - 1), "--l2-bytes", str(l2)])
    assert "--layers" in capsys.readouterr().err
    assert bench.parse_args(["--shapes", "4096x4096", "--layers", str(need), "--l2-bytes", str(l2)]).layers == need
    with pytest.raises(ValueError, match="--layers"):
        bench.layers_for(4096, 4096, ["e4m3"], l2, layers=7)  # e4m3 G=128: 7 x 16.5 MiB < 240 MiB


@pytest.mark.parametrize("shape", [(256, 384), (130, 300)])
def test_bench_layer_bytes_are_what_quantize_stores(shape):
    bench = _bench()
    for fmt in [*bench.FORMATS, "e4m7", "e5m2"]:
        name, kwargs = bench.quantize_args(fmt)
        qt = quantize(torch.randn(*shape), name, backend="torch", **kwargs)
        assert bench.layer_bytes(*shape, fmt) == qt.nbytes, fmt


def test_gpu_check_bench_arguments_parse():
    bench = _bench()
    cmds = [line for line in SCRIPT.read_text().splitlines() if line.startswith("step bench ")]
    assert len(cmds) == 1
    argv = cmds[0].split("scripts/bench_linear_cuda.py", 1)[1].replace('"$work/bench.jsonl"', "/tmp/b.jsonl").split()
    args = bench.parse_args(argv)
    assert args.shapes == ["4096x4096", "11008x4096", "4096x11008", "28672x8192"]
    assert args.tokens == [1, 2, 4, 8, 16, 32, 64, 256, 2048]


@pytest.mark.parametrize("argv,named", [(["--shapes", "4096"], "--shapes"), (["--formats", "e9m9"], "--formats"),
                                        (["--tokens", "0"], "--tokens"), (["--layers", "0"], "--layers"),
                                        (["--l2-bytes", "0"], "--l2-bytes")])
def test_bench_linear_cuda_refuses_bad_arguments(capsys, argv, named):
    with pytest.raises(SystemExit):
        _bench().parse_args(argv)
    assert named in capsys.readouterr().err
