"""What the commands share: the ``<fmt>/<Br>x<Bc>`` spelling of 2-D block scaling, the benchmark timer and the
report printer."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from typing import Callable, Optional, Sequence, Tuple

import torch

__all__ = ["parse_scheme", "make_timer", "median_ms", "report"]


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


def report(env: dict, table: str, results: Sequence, json_path: Optional[str]) -> None:
    """Print the environment line and the table; also write both as JSON to ``json_path`` if given."""
    print(", ".join(f"{k}: {v}" for k, v in env.items()))
    print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"environment": env, "results": [asdict(r) for r in results]}, fh, indent=1)
