"""scripts/gpu_check.sh, the one prepared check for a lent GPU, checked without one: bash parses it, its step time
limits fit one 10-minute device call, and scripts/bench_linear_cuda.py accepts the arguments each of its steps
passes (and refuses bad ones by name)."""

import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_linear_cuda", REPO / "scripts" / "bench_linear_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps():
    return re.findall(r"^step (\S+) (\d+) (.*)$", SCRIPT.read_text(), re.M)


def test_gpu_check_parses_and_fits_one_device_call():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    limits = [int(limit) for _, limit, _ in _steps()]
    assert len(limits) >= 7 and sum(limits) <= 570, limits  # 600 s a call, less the environment probe


def _bench_argv(cmd):
    """A step's bench_linear_cuda.py arguments, with the shell's $(seq 1 16) and "$out/..." expanded."""
    cmd = cmd.replace("$(seq 1 16)", " ".join(str(m) for m in range(1, 17))).replace('"$out/', '"/tmp/')
    argv = shlex.split(cmd)
    return argv[argv.index("scripts/bench_linear_cuda.py") + 1:]


def test_gpu_check_bench_arguments_parse():
    bench = _bench()
    calls = [bench.parse_args(_bench_argv(cmd)) for _, _, cmd in _steps() if "bench_linear_cuda.py" in cmd]
    assert len(calls) == 2 and all(args.repeat == 10 for args in calls)
    gemv = calls[1]  # issue 37: the GEMV at every M it serves, against cuBLAS and the panels path
    assert gemv.tokens == list(range(1, 17)) and gemv.shapes == ["4096x4096", "11008x4096"]
    assert gemv.paths == ["gemv", "panels"]


@pytest.mark.parametrize("argv,named", [(["--shapes", "4096"], "--shapes"), (["--formats", "e9m9"], "--formats"),
                                        (["--tokens", "0"], "--tokens"), (["--paths", "cublas"], "--paths")])
def test_bench_linear_cuda_refuses_bad_arguments(capsys, argv, named):
    with pytest.raises(SystemExit):
        _bench().parse_args(argv)
    assert named in capsys.readouterr().err
