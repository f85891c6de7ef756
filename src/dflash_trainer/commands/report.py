"""`dflash-train report RUN_DIR [--out DIR]`: the run's figures and essentials in one self-contained page."""

from __future__ import annotations

import time
from typing import Optional

from dflash_trainer.commands.out_dir import check_replaces_only_ours, checked_out_dir
from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir


def run(config: Optional[Config], args) -> int:
    from dflash_trainer.report.page import foreign_report_files, write_report

    run_dir = args.run_dir
    layout = RunDir(run_dir)
    if not layout.metrics.is_file() and not layout.summary.is_file():
        raise ConfigError(f"{run_dir} holds no metrics.jsonl or summary.json: not a training run directory")
    out = getattr(args, "out", None)
    folder = checked_out_dir(out or layout.report, flag="--out" if out else "the report folder",
                             owned_ok=layout.report)
    if out:
        check_replaces_only_ours("--out", out, foreign_report_files(folder), "report")
    start = time.perf_counter()
    index = write_report(run_dir, out)
    print(f"report: {index} (and one PNG per figure) [{time.perf_counter() - start:.1f}s]")
    return 0
