"""The peer at its best (issue 54): from the peer's step prices at the 8B shape (`peer_step_8b.sh`'s JSONs), pick
the setting that costs least per real token among those that ran at the example's anchors (any anchors when none
did), and write the bake-off cells that train it for equal 8B GPU time.

    python bench/peers/peer_best.py PRICE.json ... --cells CELLS.txt [--ours RUN.json] [--results DIR]

A price is `step_s_after_warmup` (steady steps, the compile and warm-up steps left out); its cost per real token is
that over the real (unpadded) tokens a step carries, which the row length changes. Each cell trains
MINUTES * 60 / step_s steps with `training.warmup_steps` at WARMUP_RATIO of them, the setting's rows, row length and
peer overrides, per init and seed (`bench/peers/cells/` format, for `peer_cells.sh`). Our cells' step counts were
set by our step's price on an H200 (--ours-ref-step-s); with --ours (`bench/speed/run.py`'s JSON of that step, measured
in the same call as the peer's prices) the budget is scaled by its ratio to that price, so that both sides get the
same GPU time on whichever card priced them. The pick and every price go to a JSON in --results. Exits 3 when no
setting ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import write_result  # noqa: E402
from bench.peers.peers import EXAMPLE_ANCHORS  # noqa: E402


@dataclass(frozen=True)
class PeerPrice:
    """One priced setting of the peer at the 8B shape."""

    name: str
    batch: int                 # rows per step
    seq_len: int               # padded row length
    anchors: int               # trained blocks per row
    peer_overrides: tuple[str, ...]  # the example's own overrides this setting adds (compile switches, anchors)
    ran: bool                  # False: it failed (out_of_memory says why, when it did)
    out_of_memory: bool
    step_s: float | None       # steady step time, seconds
    real_tokens_per_step: float | None
    block_size: int = 16       # the draft block (a DSpark block of 15 verifies 16 tokens)

    @property
    def s_per_real_token(self) -> float | None:
        return self.step_s / self.real_tokens_per_step if self.ran else None

    @property
    def drafter(self) -> str:
        """The peer's drafter: its `projector_type` override (dspark, domino), else DFlash."""
        key = "dflash.dflash_architecture_config.projector_type="
        return next((o.removeprefix(key) for o in self.peer_overrides if o.startswith(key)), "dflash")


def read_price(path: Path) -> PeerPrice:
    r = json.loads(path.read_text())
    ran = r.get("status") != "failed" and bool(r.get("step_s_after_warmup")) and bool(r.get("steps"))
    return PeerPrice(
        name=r["name"], batch=r["batch"], seq_len=r["seq_len"], anchors=r.get("anchors", EXAMPLE_ANCHORS),
        peer_overrides=tuple(r.get("peer_overrides", ())), ran=ran, out_of_memory=bool(r.get("out_of_memory")),
        block_size=r.get("block_size", 16),
        step_s=r["step_s_after_warmup"] if ran else None,
        real_tokens_per_step=r["real_tokens"] / r["steps"] if ran else None)


def pick(prices: list[PeerPrice], anchors: int = EXAMPLE_ANCHORS) -> PeerPrice | None:
    """The cheapest per real token among the settings that ran at `anchors`, else among all that ran."""
    ran = [p for p in prices if p.ran]
    pool = [p for p in ran if p.anchors == anchors] or ran
    return min(pool, key=lambda p: p.s_per_real_token) if pool else None


def cell_lines(best: PeerPrice, minutes: list[float], inits: list[str], seeds: list[int],
               warmup_ratio: float, card_scale: float = 1.0) -> list[str]:
    """`NAME peers.py-options` lines: `best` trained for each budget's steps at 8B, per init and seed; `card_scale`:
    this card's step time over the reference card's (our step priced on both)."""
    lines = []
    name = "modelopt-best" if best.drafter == "dflash" else f"modelopt-{best.drafter}-best"
    block = f"--block-size {best.block_size} " if best.block_size != 16 else ""
    for m in minutes:
        steps = round(m * 60 * card_scale / best.step_s)
        warmup = max(1, round(warmup_ratio * steps))
        for init in inits:
            for seed in seeds:
                lines.append(
                    f"{name}-{m:g}min-{init}-s{seed} --batch {best.batch} --seq-len {best.seq_len} {block}"
                    f"--max-steps {steps} --init {init} --seed {seed} "
                    f"--peer-overrides training.warmup_steps={warmup} {' '.join(best.peer_overrides)}".rstrip())
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prices", nargs="+", type=Path, help="peer_step_8b.sh's result JSONs")
    p.add_argument("--cells", type=Path, required=True, help="the cells file to write")
    p.add_argument("--minutes", type=float, nargs="+", default=[5.0, 15.0], help="8B GPU minutes per cell")
    p.add_argument("--inits", nargs="+", default=["random", "target"], choices=["random", "target"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--warmup-ratio", type=float, default=0.04, help="warm-up steps as a share of each cell's steps")
    p.add_argument("--ours", type=Path, default=None, help="bench/speed/run.py's JSON of our step, this call")
    p.add_argument("--ours-ref-step-s", type=float, default=0.3652,
                   help="our step's price that set our cells' step counts (5,462 tokens at 8B, one H200)")
    p.add_argument("--results", type=Path, default=None, help="write the prices and the pick here as a JSON")
    args = p.parse_args(argv)
    prices = [read_price(path) for path in args.prices]
    print("| setting | rows x length | anchors | ran | step s | real tokens / step | us per real token |")
    print("|---|---|---|---|---|---|---|")
    for x in prices:
        cost = f"{x.s_per_real_token * 1e6:.1f}" if x.ran else ("out of memory" if x.out_of_memory else "failed")
        step = f"{x.step_s:.3f}" if x.ran else "-"
        tokens = f"{x.real_tokens_per_step:,.0f}" if x.ran else "-"
        print(f"| {x.name} | {x.batch} x {x.seq_len} | {x.anchors} | {x.ran} | {step} | {tokens} | {cost} |")
    best = pick(prices)
    if best is None:
        print("no priced setting ran: nothing to train")
        return 3
    ours_step_s = json.loads(args.ours.read_text())["step_ms"] / 1000 if args.ours else None
    card_scale = ours_step_s / args.ours_ref_step_s if ours_step_s else 1.0
    print(f"our step here: {ours_step_s} s against {args.ours_ref_step_s} s on the reference card: budgets x {card_scale:.3f}")
    lines = cell_lines(best, args.minutes, args.inits, args.seeds, args.warmup_ratio, card_scale)
    args.cells.write_text("\n".join(lines) + "\n")
    print(f"picked {best.name} ({best.s_per_real_token * 1e6:.1f} us per real token); {len(lines)} cells in {args.cells}")
    if args.results:
        write_result({"bench": "peers", "what": "peer-best-pick", "picked": best.name, "ours_step_s": ours_step_s,
                      "ours_ref_step_s": args.ours_ref_step_s, "card_scale": card_scale,
                      "prices": [asdict(x) | {"s_per_real_token": x.s_per_real_token} for x in prices],
                      "cells": lines}, "peers", "peer-best-pick", args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
