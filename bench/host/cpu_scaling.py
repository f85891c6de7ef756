"""How CPU-bound work scales with processes on this host: the same pure-Python loop in K processes at once.

    python bench/host/cpu_scaling.py [--processes 1,2,4,8,16] [--loops 5000000]

Per K: the wall time of K processes each running the loop once (spawned and importing nothing heavy, so start-up is
small), the aggregate loops/s against K=1's, and the CPU time the host's kernel counted as stolen by its
hypervisor (/proc/stat `steal`) during the run. A host whose vCPUs are backed by fewer physical cores scales
below K and shows steal. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time


def busy(loops: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(loops):
        total += i
    return time.perf_counter() - start


def cpu_ticks() -> dict[str, int]:
    """The host's summed CPU time by kind (USER_HZ ticks), from /proc/stat's first line; {} where absent."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return {}
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {name: int(value) for name, value in zip(names, fields)}


def run(processes: int, loops: int) -> dict:
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        pool.map(busy, [1000] * processes)  # every worker started before the clock starts
        before = cpu_ticks()
        start = time.perf_counter()
        per_process = pool.map(busy, [loops] * processes, chunksize=1)
        wall = time.perf_counter() - start
        after = cpu_ticks()
    spent = {k: after[k] - before[k] for k in after} if before and after else {}
    busy_ticks = sum(v for k, v in spent.items() if k != "idle")
    return {"processes": processes, "wall_s": wall, "loops_per_s": processes * loops / wall,
            "slowest_s": max(per_process), "fastest_s": min(per_process),
            "steal_frac": spent.get("steal", 0) / busy_ticks if busy_ticks else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", default="1,2,4,8,16")
    p.add_argument("--loops", type=int, default=5_000_000)
    args = p.parse_args(argv)
    counts = [int(k) for k in args.processes.split(",")]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [run(k, args.loops) for k in counts]
    base = rows[0]["loops_per_s"] / rows[0]["processes"]
    print(f"CPUs this process may run on: {cpus}")
    print(f"{'processes':>10}{'wall s':>9}{'slowest s':>11}{'fastest s':>11}{'x one':>8}{'steal':>8}")
    for r in rows:
        r["speedup"] = r["loops_per_s"] / base
        steal = "-" if r["steal_frac"] is None else f"{r['steal_frac']:.0%}"
        print(f"{r['processes']:>10}{r['wall_s']:>9.2f}{r['slowest_s']:>11.2f}{r['fastest_s']:>11.2f}"
              f"{r['speedup']:>8.2f}{steal:>8}")
    print(json.dumps({"bench": "cpu_scaling", "cpus": cpus, "loops": args.loops, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
