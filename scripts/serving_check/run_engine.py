"""One engine's process: `python run_engine.py --engine vllm|sglang --work DIR` runs every job of DIR/jobs.json
in that engine and writes DIR/results-ENGINE.json (one result per job; a job's exception is its result)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the package as serving_check, its files not top-level

from serving_check.jobs import ENGINES, EngineResult, read_jobs, write_results  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the machine's cores may be shared
    if args.engine == "sglang":
        from serving_check import stubs

        stubs.install_for_sglang()
        from serving_check import engine_sglang as engine
    else:
        from serving_check import stubs

        stubs.install_for_vllm()
        from serving_check import engine_vllm as engine
    results = []
    for job in read_jobs(args.work / "jobs.json"):
        if job.refused:
            continue
        out_file = str(args.work / f"{args.engine}-{job.id.replace('/', '-')}.pt")
        try:
            results.append(engine.run(job, out_file))
        except Exception as e:  # the job's result: the check prints it and fails
            traceback.print_exc()
            results.append(EngineResult(job=job.id, engine=args.engine, status="error",
                                        detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        print(json.dumps({"job": job.id, "status": results[-1].status}), flush=True)
    write_results(args.work / f"results-{args.engine}.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
