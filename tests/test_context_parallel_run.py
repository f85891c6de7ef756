"""A real context-parallel run: `dflash-train train` under torchrun on 2 CPU ranks (gloo) at
pipeline.context_parallel=2, against the same jobs trained on one rank at CP=1."""

from __future__ import annotations

import json
from collections import Counter

import torch
from pipeline_helpers import assert_ok, committed_jobs, inline_losses, metrics, planned_jobs, torchrun

STEPS = 4
CP_RUN = ("pipeline.context_parallel=2", "pipeline.colocated=true", "pipeline.token_budget=256",
          "data.max_length=256", "train.grad_accum=1", f"train.max_steps={STEPS}", "eval.interval=0",
          "drafter.noise=gaussian", "drafter.noise_std=0.05")
"""One sequence a job, sharded over the group's 2 ranks; tap noise on (drawn on the whole sequence, then sliced)."""


def test_cp2_run_equals_the_one_rank_steps(tmp_path):
    """One CP group of 2 ranks trains STEPS steps: each job is committed once (not once per rank), the tokens and
    batches are counted once, and every step's loss equals the one-rank CP=1 step on the same job (the target's
    forward run whole, the drafter's step over all blocks, same seeds: `inline_losses`)."""
    run_dir = tmp_path / "run"
    s = assert_ok(torchrun(run_dir, 2, *CP_RUN, timeout_s=120.0))
    rows = [r for r in metrics(run_dir) if "loss" in r]
    order = committed_jobs(rows)
    assert len(rows) == STEPS and all(len(r["jobs"]) == 1 for r in rows), rows
    assert not [j for j, n in Counter(order).items() if n > 1], order
    assert set(order) <= set(planned_jobs(run_dir))
    plan = json.loads((run_dir / "plan" / "epoch_0.json").read_text())
    tokens = {job["job_id"]: job["num_tokens"] for job in plan["jobs"]}
    assert [(r["batches"], r["tokens"]) for r in rows] == [(1, tokens[j]) for j in order]  # counted once per group
    assert s["roles"] == ["colocated", "colocated"]
    one_rank = inline_losses(run_dir, CP_RUN, order)  # one rank, no CP group: whole sequences
    sharded = [r["loss"] for r in rows]
    assert len(one_rank) == len(sharded)
    assert torch.allclose(torch.tensor(sharded), torch.tensor(one_rank), rtol=1e-4, atol=1e-5), (sharded, one_rank)
