"""The run summary (`RUN_DIR/summary.json`): what trained, how fast each side ran, and how it ended."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dflash_trainer.rundir import RunDir, write_atomic
from dflash_trainer.train.trainer import TrainResult
from dflash_trainer.transport.pool import PoolReport

if TYPE_CHECKING:
    from dflash_trainer.runtime.setup import RunSetup


@dataclass
class TargetStats:
    """One target rank's side of the run (a colocated rank's target half), reported to the leader."""

    rank: int = -1
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0
    bytes_moved: int = 0
    slot_wait_s: float = 0.0
    """Time the forward waited for a free send slot (backpressure from the drafters)."""
    batches_to: dict[str, int] = field(default_factory=dict)
    """Batches sent to each drafter rank (its rank as a string: the stats travel as JSON); none when colocated."""


def run_summary(setup: "RunSetup", result: TrainResult, targets: list[TargetStats], pools: list[PoolReport]) -> dict:
    """`pools`: every drafter's pool report, the leader's first."""
    planned = {e: len(jobs) for e, jobs in enumerate(setup.plans_jobs)}
    trained = {e: len(set(ids)) for e, ids in result.ledger.items()}
    duplicated = sum(len(ids) - len(set(ids)) for ids in result.ledger.values())
    target_tokens = sum(t.tokens for t in targets)
    target_busy = sum(t.busy_s for t in targets)
    target_wall = sum(t.wall_s for t in targets)
    drafter_wall = result.elapsed_s
    rates = result.throughput  # tokens/s (steady), overall and T are defined in train/throughput.py
    return {
        "status": "ok",
        "run_dir": str(setup.run_dir),
        "world_size": setup.env.world_size,
        "roles": [r.value for r in setup.placement.roles],
        "steps": result.state.step,
        "skipped_steps": result.state.skipped_steps,
        "jobs_planned": {str(e): n for e, n in planned.items()},
        "jobs_trained": {str(e): trained.get(e, 0) for e in planned},
        "jobs_duplicated": duplicated,
        "tokens_trained": result.state.tokens,
        "training_minutes": round(result.state.time_spent_s / 60, 3),
        "I_tokens_per_s": target_tokens / target_busy if target_busy > 0 else None,
        "T_tokens_per_s": rates.drafter_tokens_per_s if rates else None,
        "tokens_per_s": rates.tokens_per_s if rates else None,
        "overall_tokens_per_s": rates.overall_tokens_per_s if rates else None,
        "warmup_steps": rates.warmup_steps if rates else None,
        "drafter_wait_frac": result.wait_time_s / drafter_wall if drafter_wall > 0 else None,
        "target_idle_frac": (1 - target_busy / target_wall) if target_wall > 0 and not setup.placement.colocated else None,
        "pool_depth_max": max(p.depth_max for p in pools),
        "pool_depth_mean": sum(p.depth_sum for p in pools) / max(1, sum(p.takes for p in pools)),
        "pool_occupied_max": max(p.occupied_max for p in pools),
        "pool_capacity": setup.config.pipeline.pool_capacity,
        "target_batches": {str(t.rank): t.batches for t in targets},
        "target_sends": {str(t.rank): t.batches_to for t in targets if t.batches_to},
        "rank_time": [{"rank": t.rank, "role": "target", "busy_s": t.busy_s, "wall_s": t.wall_s} for t in targets]
        + [{"rank": setup.placement.drafter_ranks[0], "role": "drafter (leader)", "busy_s": result.step_time_s,
            "wall_s": drafter_wall}],
        "target_slot_wait_s": sum(t.slot_wait_s for t in targets),
        "bytes_moved": sum(t.bytes_moved for t in targets),
        "final_loss": result.last_record.loss if result.last_record else None,
        "final_acc": result.last_record.accuracy if result.last_record else None,
        "final_sim_tau": result.last_record.sim_tau if result.last_record else None,
        "eval": asdict(result.eval) if result.eval is not None else None,
        "checkpoints": result.checkpoints,
        "export_dir": result.export_dir,
    }


def write_summary_file(run_dir: Path, summary: dict) -> None:
    write_atomic(RunDir(run_dir).summary, json.dumps(summary, indent=2))


def write_failed_summary(run_dir: Optional[Path], rank: int, cause: str, *, keep_existing: bool = False) -> None:
    """`summary.json` with status failed; `keep_existing`: leave a failure summary already written alone. Never
    creates the run dir (rank 0 removes one that a failed start created)."""
    if run_dir is None or not Path(run_dir).is_dir():
        return
    path = RunDir(run_dir).summary
    if keep_existing and _status(path) == "failed":
        return
    try:
        write_summary_file(run_dir, {"status": "failed", "failed_rank": rank, "cause": cause})
    except (OSError, ValueError):
        pass


def _status(path: Path) -> Optional[str]:
    """The `status` of a summary file, or None when it is missing or damaged (then it is written anew)."""
    try:
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return summary.get("status") if isinstance(summary, dict) else None


def print_summary(summary: dict, run_dir: Path) -> None:
    keys = ["status", "steps", "tokens_trained", "training_minutes", "final_loss", "final_acc", "final_sim_tau", "eval",
            "jobs_planned", "jobs_trained", "jobs_duplicated", "tokens_per_s", "overall_tokens_per_s", "I_tokens_per_s",
            "T_tokens_per_s", "drafter_wait_frac", "target_idle_frac", "pool_depth_max", "elapsed_s", "export_dir"]
    labels = {"tokens_per_s": f"tokens_per_s (steady, after {summary.get('warmup_steps')} warm-up steps)",
              "overall_tokens_per_s": "overall_tokens_per_s (warm-up included)",
              "training_minutes": "training_minutes (every session, evaluations left out)",
              "I_tokens_per_s": "I_tokens_per_s (target capacity)",
              "T_tokens_per_s": "T_tokens_per_s (drafter capacity, waits left out)"}
    width = max(len(labels.get(k, k)) for k in keys)
    lines = [f"{labels.get(k, k):<{width}}  {_fmt(summary.get(k))}" for k in keys]
    print("\n".join(["", "run summary", *lines, f"{'run dir':<{width}}  {run_dir}"]), flush=True)


def _fmt(v) -> str:
    """A summary value as people read it: numbers rounded, mappings as `key: value, ...`, the evaluation in a line."""
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, dict) and "tau" in v:
        return _eval_line(v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _eval_line(ev: dict) -> str:
    """The final evaluation: real tau with its error, prompt lookup beside it, the best checkpoint, walk tau."""
    parts = [f"real tau {_fmt(ev['tau'])}" + (f" ± {_fmt(ev['tau_stderr'])}" if ev.get("tau_stderr") else "")
             + f" at step {ev.get('step')}"]
    if ev.get("prompt_lookup_tau") is not None:
        parts.append(f"prompt lookup {_fmt(ev['prompt_lookup_tau'])}")
    if ev.get("best_step") is not None:
        parts.append(f"best {_fmt(ev['best_tau'])} at step {ev['best_step']} ({ev.get('best_dir')})")
    if (ev.get("val") or {}).get("walk_tau") is not None:
        parts.append(f"held-out walk tau {_fmt(ev['val']['walk_tau'])}")
    return "; ".join(parts)
