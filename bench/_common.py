"""Shared output for benchmarks: each prints exactly one figure line.

    BENCH <name>: <value> <unit> vs <baseline name> <baseline> <unit> ratio <r> (target <op> <t>) PASS|MISS
"""

from __future__ import annotations

import os
import resource
import sys


def report(name: str, value: float, unit: str, baseline_name: str, baseline: float, *, target: float,
           higher_is_better: bool = True, extra: str = "") -> float:
    ratio = (value / baseline) if baseline else float("inf")
    ok = ratio >= target if higher_is_better else ratio <= target
    op = ">=" if higher_is_better else "<="
    line = (f"BENCH {name}: {value:.4g} {unit} vs {baseline_name} {baseline:.4g} {unit} "
            f"ratio {ratio:.3g} (target {op} {target:g}) {'PASS' if ok else 'MISS'}")
    if extra:
        line += f" [{extra}]"
    print(line, flush=True)
    return ratio


def report_limit(name: str, value: float, unit: str, *, limit: float, baseline_name: str = "", baseline: float = 0.0) -> None:
    """A figure against an absolute limit (peak RSS), with its baseline for context."""
    ok = value <= limit
    ctx = f" vs {baseline_name} {baseline:.4g} {unit} ratio {value / baseline:.3g}" if baseline else ""
    print(f"BENCH {name}: {value:.4g} {unit}{ctx} (limit <= {limit:g} {unit}) {'PASS' if ok else 'MISS'}", flush=True)


def peak_rss_mb_of_children() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def quick() -> bool:
    """BENCH_QUICK=1 shrinks sizes so a bench can run as a smoke test."""
    return os.environ.get("BENCH_QUICK", "") not in ("", "0")


if __name__ == "__main__":
    sys.exit("import me")
