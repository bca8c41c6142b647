"""What the commands share: the ``<fmt>/<Br>x<Bc>`` spelling of 2-D block scaling, the benchmark timer, the
report printer and the results files of ``--results``."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict
from typing import Callable, Optional, Sequence, Tuple

import torch

__all__ = ["parse_scheme", "make_timer", "median_ms", "report", "results_paths", "RESULTS_DIR"]

#: Where ``--results NAME`` writes ``NAME.md`` and ``NAME.json`` (relative to the folder the command runs in: the
#: repository root, where the measurement history is kept).
RESULTS_DIR = os.path.join("benchmarks", "results")


def parse_scheme(text: str) -> Tuple[str, Optional[Tuple[int, int]]]:
    """``"e4m3"`` -> ``("e4m3", None)``; ``"e4m3/128x128"`` -> ``("e4m3", (128, 128))`` (2-D blocks of
    ``Br x Bc`` elements, SPEC 2). The format name itself is checked by the quantize call that uses it.

    Raises:
        ValueError: a block part that is not ``<int>x<int>``.
    """
    fmt, slash, block = text.partition("/")
    if not slash:
        return fmt, None
    parts = block.split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r}: the block after '/' must be <rows>x<cols>, e.g. e4m3/128x128")
    return fmt, (int(parts[0]), int(parts[1]))


def make_timer(device: torch.device, repeat: int, warmup: int = 1) -> Callable[[Callable[[], object]], float]:
    """A function that returns the median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs (CUDA
    events on a CUDA device, ``time.perf_counter`` elsewhere)."""

    def measure(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of ``fn()`` on the CPU over ``repeat`` runs after one warm-up run."""
    return make_timer(torch.device("cpu"), repeat, warmup=1)(fn) * 1e3


def results_paths(name: str) -> Tuple[str, str]:
    """The markdown and JSON files of ``--results name``: ``benchmarks/results/<name>.md`` and ``.json`` under the
    current folder, or ``<name>.md`` / ``.json`` where ``name`` has a folder in it (a ``.md`` / ``.json`` ending is
    dropped first)."""
    stem = name[:-3] if name.endswith(".md") else name[:-5] if name.endswith(".json") else name
    if not os.path.dirname(stem):
        stem = os.path.join(RESULTS_DIR, stem)
    return stem + ".md", stem + ".json"


def _git_head() -> Optional[str]:
    """The short commit of the checkout the package runs from, ``+dirty`` with uncommitted changes; ``None`` outside
    a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def report(env: dict, table: str, results: Sequence, json_path: Optional[str], results_name: Optional[str] = None,
           title: str = "ds-fpquant bench", command: Optional[str] = None) -> None:
    """Print the environment line and the table; also write both as JSON to ``json_path`` if given. With
    ``results_name`` (``--results``), write the run's file pair (:func:`results_paths`): a markdown file with
    ``title``, the command, date and commit, the environment and ``table``, and the JSON of the run with the same
    header fields."""
    print(", ".join(f"{k}: {v}" for k, v in env.items()))
    print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"environment": env, "results": [asdict(r) for r in results]}, fh, indent=1)
    if results_name:
        md_path, json_file = results_paths(results_name)
        os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
        header = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "commit": _git_head()}
        lines = [f"# {title}", "", f"`{command}`, {header['date']}, commit {header['commit'] or 'unknown'}; every "
                 "number and ratio below is from this one run.", ""]
        lines += [f"- {k}: {v}" for k, v in env.items()]
        lines += ["", table, ""]
        with open(md_path, "w") as fh:
            fh.write("\n".join(lines))
        with open(json_file, "w") as fh:
            json.dump({**header, "environment": env, "results": [asdict(r) for r in results]}, fh, indent=1)
        print(f"wrote {md_path} and {json_file}")


def ratio_text(v: Optional[float]) -> str:
    """A table cell for a speed ratio: ``"1.23x"``, or ``"-"`` where there is none."""
    return "-" if v is None else f"{v:.2f}x"
