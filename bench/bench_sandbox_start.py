"""What the agents' namespace sandbox costs per command: the wall time of
`/bin/true` started in a fresh bubblewrap sandbox (adapters/agents/jail.py:
its namespaces, its filesystem, the init that drops to the turn's uid and
sets the limits), with network "none" and with "proxy" (the forwarder to the
egress proxy too), against `/bin/true` started directly. p50 over N starts,
interleaved.

    python -m bench.bench_sandbox_start          (BENCH_QUICK=1: 20 of each)

One figure: the sandboxed start-up p50 (network none), against the plain
start; target: under 100 ms a command (a bridge turn pays it once, the
built-in loop once per terminal command). The proxy's figure is beside it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import quick  # noqa: E402

LIMIT_MS = 100.0


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1000.0


def main() -> int:
    from adapters.agents.jail import Jail, JailConfig, unavailable

    why = unavailable(JailConfig())
    if why:
        print(f"bubblewrap cannot isolate here: {why}", file=sys.stderr)
        return 1
    n = 20 if quick() else 200
    env = {"PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory(prefix="courier-bench-jail-") as tmp:
        ws = Path(tmp) / "ws"
        ws.mkdir()
        with Jail(JailConfig(), str(ws), "turn_bench") as jail:
            none_argv = jail.argv(["/bin/true"], env, network="none")
            proxy_argv = jail.argv(["/bin/true"], env, network="proxy")
            plain, none, proxy = [], [], []
            for _ in range(3):
                _time(none_argv), _time(proxy_argv), _time(["/bin/true"])
            for _ in range(n):
                plain.append(_time(["/bin/true"]))
                none.append(_time(none_argv))
                proxy.append(_time(proxy_argv))
    p, s, x = statistics.median(plain), statistics.median(none), statistics.median(proxy)
    ok = s <= LIMIT_MS
    print(f"BENCH sandbox_start_p50: {s:.4g} ms vs plain exec {p:.4g} ms ratio {s / p:.3g} "
          f"(limit <= {LIMIT_MS:g} ms) {'PASS' if ok else 'MISS'} [network proxy p50 {x:.4g} ms; "
          f"p90 none {sorted(none)[int(0.9 * n)]:.4g} ms, proxy {sorted(proxy)[int(0.9 * n)]:.4g} ms; n={n} each]",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
