"""`dflash-train bench`: the benchmarks are scripts in the source tree's `bench/` (they print a table and
write JSON); this subcommand points there."""

from __future__ import annotations

from dflash_trainer.errors import NotBuiltYet


def run(config, args) -> int:
    raise NotBuiltYet(
        "`dflash-train bench` has no in-package runner yet: from a source checkout on a GPU machine run "
        "`python bench/run.py --model qwen3-8b --workload mfu` (see bench/README.md)"
    )
