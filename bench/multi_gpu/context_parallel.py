"""Context parallel on one host's GPUs (issue 38): real `dflash-train train` runs on long sequences, one GPU
(CP=1) against one context-parallel group of N GPUs (`pipeline.context_parallel=N`), in one call.

    python bench/multi_gpu/context_parallel.py --seq-len 65536 --cp 2,4                 # an x4 machine: 1 GPU, CP=2, CP=4
    python bench/multi_gpu/context_parallel.py --seq-len 262144 --cp 4 --no-baseline    # past what one GPU holds
    python bench/multi_gpu/context_parallel.py --smoke                                  # CPU + gloo, tiny target: CP=1, 2

Each run trains --steps steps of one --seq-len-token sequence a step (`pipeline.token_budget` = --seq-len) on long
conversations written first: a prompt of --source (default: the bundled ShareGPT), then its messages joined into
one reply past --seq-len tokens (cut there by `data.max_length`), standing in for a reasoning target's long trace. The target has random
weights and the Qwen3-8B shape, its `max_position_embeddings` raised to the length (the work per token does not
change); the drafter is the 8B recipe's, its blocks chunked by the planner (`train.blocks_per_chunk: 0`).
Throughput is steady state as in bench/multi_gpu/scaling.py (the last half of the steps); a CP=N run's speed-up is its
tokens/s over the one-GPU run's, its efficiency that over N. `--set k=v` adds overrides to every run (for example
drafter.flex_kernel_options.BACKEND=FLASH). The last line printed is JSON, also written to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import ROOT, git_commit, or_dash, write_result
from bench.multi_gpu import scaling
from bench.multi_gpu.scaling import add_run_arguments, run_one

sys.path.insert(0, str(ROOT / "src"))

from dflash_trainer.data.config import DataSourceConfig  # noqa: E402
from dflash_trainer.data.sources import load_source  # noqa: E402
from dflash_trainer.target.presets import preset_config  # noqa: E402

CHARS_PER_TOKEN = 8
"""Characters written per token wanted: more than the tokenizers here average, so every reply is cut at the length."""

GPU_OVERRIDES = [*scaling.GPU_OVERRIDES, "target.attn_implementation=sdpa", "drafter.loss_chunk_rows=4096",
                 "train.blocks_per_chunk=0"]
"""bench/multi_gpu/scaling.py's 8B runs, with the long-context recipe's attention and chunking (its lengths replaced later)."""
SMOKE_OVERRIDES = ["train.grad_accum=1"]
COMMON_OVERRIDES = ["pipeline.colocated=true", "train.num_epochs=1", "train.checkpoint_interval=100000",
                    "eval.interval=0", "eval.at_end=false", "logging.progress=false"]


def write_long_conversations(out: Path, *, source: str, tokens: int, count: int, seed: int = 0) -> Path:
    """`count` ShareGPT-format conversations as JSONL, each a user prompt of `source` and one reply of at least
    `tokens` x CHARS_PER_TOKEN characters made of `source`'s messages (any role) in a shuffled order."""
    conversations = load_source(DataSourceConfig(path=source), limit=2000, purpose=None).conversations
    prompts = [c.messages[0].content for c in conversations if c.messages[0].role == "user"]
    texts = [m.content for c in conversations for m in c.messages if m.content.strip()]
    if not prompts:
        raise SystemExit(f"--source {source}: no conversation starts with a user turn")
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i in range(count):
            parts, length = [], 0
            while length < tokens * CHARS_PER_TOKEN:
                parts.append(rng.choice(texts))
                length += len(parts[-1]) + 2
            turns = [{"from": "human", "value": prompts[i % len(prompts)]}, {"from": "gpt", "value": "\n\n".join(parts)}]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return out


def long_target(out: Path, preset: str, seq_len: int) -> Path:
    """A config folder of `preset` whose max_position_embeddings holds `seq_len` (for target.random_init)."""
    config = preset_config(preset)
    config.max_position_embeddings = max(config.max_position_embeddings, seq_len)
    config.save_pretrained(out)
    return out


def run_plan(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, overrides) of each run: one rank first (the baseline) unless --no-baseline, then each CP size."""
    plan = [] if args.no_baseline else [("1 rank", 1, ["pipeline.context_parallel=1"])]
    for n in (int(x) for x in args.cp.split(",") if x.strip()):
        if n < 2 or args.seq_len % n:
            raise SystemExit(f"--cp {n}: a CP group needs 2+ ranks that divide --seq-len {args.seq_len}")
        plan.append((f"CP={n}", n, [f"pipeline.context_parallel={n}"]))
    if not plan:
        raise SystemExit("nothing to run: give --cp sizes, or drop --no-baseline")
    return plan


def run_overrides(args: argparse.Namespace, *, data: Path, target: Path) -> list[str]:
    """The overrides of the demo recipe that every run shares: the shape, the long data, one sequence a step."""
    return [*(SMOKE_OVERRIDES if args.smoke else GPU_OVERRIDES), *COMMON_OVERRIDES, f"target.random_init={target}",
            f"data.path={data}", f"data.max_length={args.seq_len}", f"pipeline.token_budget={args.seq_len}",
            f"train.max_steps={args.steps}", *args.overrides]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=65536, help="tokens of each step's one sequence")
    p.add_argument("--cp", default="2", help="comma list of CP group sizes (each run uses that many GPUs)")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-GPU run (a length it cannot hold)")
    p.add_argument("--preset", default="qwen3-8b", help="the target's shape (bench/speed/run.py's presets)")
    p.add_argument("--source", default="sharegpt", help="data.path of the text the long conversations are made of "
                   "(the device machine has no ShareGPT package: a carried prompt file)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    add_run_arguments(p, steps=8, work_dir="/tmp/dflash-cp")
    p.add_argument("--smoke", action="store_true", help="CPU + gloo, the tiny target at 256 tokens: 1 rank, CP=2")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.cp, args.steps, args.preset = 256, "2", min(args.steps, 4), "tiny"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = run_plan(args)
    work = Path(args.work_dir) / datetime.now().strftime("%Y%m%dT%H%M%S")
    data = write_long_conversations(work / "long.jsonl", source=args.source, tokens=args.seq_len,
                                    count=args.steps + 16)
    target = long_target(work / "target", args.preset, args.seq_len)
    common = run_overrides(args, data=data, target=target)
    results = [run_one(name, ranks, common + extra, work, args.timeout_s) for name, ranks, extra in plan]
    single = results[0]["steady_tokens_per_s"] if results[0]["ranks"] == 1 else None
    for r in results:
        tps = r["steady_tokens_per_s"]
        r["speedup"] = tps / single if tps and single else None
        r["efficiency"] = r["speedup"] / r["ranks"] if r["speedup"] else None

    print(f"\ncontext parallel ({'CPU smoke' if args.smoke else 'GPU'}; {args.preset} target, one {args.seq_len:,}-token "
          f"sequence a step, {args.steps} steps per run; steady = last half)")
    print(f"{'run':<10}{'ranks':>6}{'tokens/s':>11}{'speed-up':>10}{'efficiency':>12}{'seconds':>9}  status")
    for r in results:
        print(f"{r['name']:<10}{r['ranks']:>6}{or_dash(r['steady_tokens_per_s'], '{:.0f}'):>11}"
              f"{or_dash(r['speedup']):>10}{or_dash(r['efficiency']):>12}{r['seconds']:>9.0f}  "
              f"{r['status'] or r['rc']}")
    result = {"bench": "context_parallel", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "smoke": args.smoke, "preset": args.preset, "seq_len": args.seq_len,
              "steps": args.steps, "overrides": args.overrides, "command": " ".join([sys.executable, *sys.argv]),
              "results": results}
    write_result(result, "context_parallel", str(args.seq_len), args.out)
    print(json.dumps(result))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
