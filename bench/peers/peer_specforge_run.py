"""Run SpecForge's DFlash training script (`scripts/train_dflash.py` of its source, fetched into `.peer/specforge`,
not part of this repository) for exactly N steps, and record what it trained. Started by `bench/peers/peer_specforge.py`
under torchrun; runs in the peer's Python, with its source on the path.

    torchrun --standalone --nproc_per_node 1 bench/peers/peer_specforge_run.py --script SCRIPT --max-steps N \\
        --stats FILE.json -- SCRIPT'S OWN ARGUMENTS (with --num-epochs 1)

The script has no step cap: it trains `--num-epochs` whole passes over its loader and sizes its schedule from
the loader's length. What is added around the unchanged script, through the one loader it builds for training
(`specforge.data.prepare_dp_dataloaders` with shuffling on):
- that loader is handed over as one of exactly `--max-steps` batches: when a pass over the data ends, the next
  begins with the next epoch's shuffle (what the script's own next epoch would draw), so its warm-up and cosine
  schedule end at step N and it saves its final checkpoint there (`OUTPUT_DIR/epoch_1_step_N`);
- the end of every step: the host time at which the script asks for the next batch, from the first step's start
  (its progress bar has already read the step's loss, a host sync, so the synchronize here waits for nothing);
- the real (non-padding), padded and loss tokens of every batch, counted on the host from the collated masks.
`--stats` gets: steps, seconds from the first step's start to the last step's end, the token counts, step times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import runpy
import sys
import time
from pathlib import Path


class StepCappedLoader:
    """`loader` (a DataLoader over a DistributedSampler) as exactly `steps` batches, walked once."""

    def __init__(self, loader, steps: int, stats_path: Path) -> None:
        if len(loader) == 0:
            raise SystemExit("peer_specforge_run: the training loader is empty (fewer rows than one batch)")
        self.loader, self.steps, self.stats_path = loader, steps, stats_path
        self.sampler = loader.sampler  # the script sets epoch 0 on it; each pass below sets its own
        self.walked = False

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        if self.walked:
            raise SystemExit("peer_specforge_run: the loader was walked twice; run the script with --num-epochs 1")
        self.walked = True
        counts = {"real_tokens": 0, "padded_tokens": 0, "loss_tokens": 0}
        start, ends = None, []
        for epoch in itertools.count():
            self.loader.sampler.set_epoch(epoch)
            for batch in self.loader:
                start = time.perf_counter() if start is None else start
                counts["real_tokens"] += int(batch["attention_mask"].sum())  # CPU tensors: no device sync
                counts["padded_tokens"] += batch["attention_mask"].numel()
                counts["loss_tokens"] += int(batch["loss_mask"].sum())
                yield batch
                ends.append(self.now() - start)  # the script asks for the next batch: this step has ended
                if len(ends) == self.steps:
                    self.write_stats(counts, ends, passes=epoch + 1)
                    return

    @staticmethod
    def now() -> float:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # timing boundary (the script has synced on this step's loss already)
        return time.perf_counter()

    def write_stats(self, counts: dict, ends: list[float], passes: int) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        stats = {"steps": len(ends), "seconds": ends[-1], **counts, "data_passes": passes, "step_ends_s": ends}
        self.stats_path.write_text(json.dumps(stats))


def cap_training_loader(steps: int, stats_path: Path) -> None:
    """Make the script's training loader (the one built with shuffling) a `StepCappedLoader`."""
    import specforge.data

    original = specforge.data.prepare_dp_dataloaders

    def prepare_dp_dataloaders(dataset, batch_size, *args, **kwargs):
        loader = original(dataset, batch_size, *args, **kwargs)
        return StepCappedLoader(loader, steps, stats_path) if kwargs.get("shuffle") else loader

    specforge.data.prepare_dp_dataloaders = prepare_dp_dataloaders  # the script imports it from here at its start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--script", type=Path, required=True, help="SpecForge's scripts/train_dflash.py")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the script's own arguments")
    args = p.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    cap_training_loader(args.max_steps, args.stats.resolve())
    script = args.script.resolve()
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
