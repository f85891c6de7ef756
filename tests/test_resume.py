"""Kill a multi-process run after a checkpoint (one rank, or the whole job, with SIGKILL), resume it with
`--resume` in the same run dir, also on another target/drafter split: over both runs every planned job is
committed exactly once, and in deterministic mode the resumed loss curve equals the uninterrupted one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from pipeline_helpers import (
    assert_ok,
    checkpoints,
    committed_jobs,
    inline_losses,
    ledger,
    metrics,
    planned_jobs,
    torchrun,
    train_in_process,
)

SPLIT_1_2 = ("pipeline.colocated=false", "pipeline.num_targets=1", "train.checkpoint_interval=2")


@pytest.fixture(autouse=True)
def _no_fault_in_process(monkeypatch):
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)


def _last_checkpoint(run_dir, step: int) -> tuple[int, list[int]]:
    """(metrics rows so far, the ledger of run 1's last checkpoint), read before run 2 rotates it away."""
    last = checkpoints(run_dir)[-1]
    assert last.name == f"step_{step}", last
    return len(metrics(run_dir)), ledger(last)


def _assert_exactly_once_over_runs(run_dir, rows_before: int, kept: list[int], last_checkpoint_step: int) -> list[int]:
    """The ledger of run 1's last checkpoint and the jobs run 2 committed partition the plan."""
    everything = [r for r in metrics(run_dir) if "jobs" in r]
    steps = [r["step"] for r in everything]
    assert len(steps) == len(set(steps)), steps  # a resume drops the killed run's rows past its checkpoint
    rows = [r for r in everything if r["step"] > last_checkpoint_step]
    assert rows and rows[0]["step"] == last_checkpoint_step + 1, rows[:1]  # continues after the checkpoint
    redone = committed_jobs(rows)
    assert not [j for j, n in Counter(redone).items() if n > 1], redone
    assert not set(kept) & set(redone), set(kept) & set(redone)  # nothing committed twice across runs
    assert sorted(kept + redone) == sorted(planned_jobs(run_dir))  # nothing lost
    return redone


def test_sigkill_of_a_drafter_then_resume_on_another_split(tmp_path):
    """Run 1: 1 target + 2 drafters; drafter rank 2 is killed with SIGKILL after step 3 (checkpoint at 2): the
    job fails fast and torchrun names the killed rank. Run 2 resumes it as 2 targets + 1 drafter."""
    run_dir = tmp_path / "run"
    first = torchrun(run_dir, 3, *SPLIT_1_2, fault="kill:3@2", timeout_s=90)
    assert first.returncode != 0 and first.elapsed_s < 60, (first.returncode, first.elapsed_s)
    root = first.output.split("Root Cause (first observed failure):")[-1]
    assert "rank      : 2 (local_rank: 2)" in root and "Signal 9 (SIGKILL)" in root, root[:2000]
    assert [c.name for c in checkpoints(run_dir)] == ["step_2"]
    rows_before, kept = _last_checkpoint(run_dir, 2)
    assert rows_before == 3 and len(kept) == 4

    s = assert_ok(torchrun(run_dir, 3, *SPLIT_1_2, "pipeline.num_targets=2", resume=True))
    assert s["roles"] == ["target", "target", "drafter"]
    _assert_exactly_once_over_runs(run_dir, rows_before, kept, 2)
    n = len(planned_jobs(run_dir))
    assert s["jobs_trained"] == {"0": n} and s["jobs_duplicated"] == 0, s


def test_sigkill_of_the_whole_job_then_resume_in_one_process(tmp_path):
    """Run 1: 1 target + 2 drafters; torchrun and every rank are killed with SIGKILL after step 5
    (checkpoint at 4). Run 2 resumes in one process (colocated)."""
    run_dir = tmp_path / "run"
    first = torchrun(run_dir, 3, *SPLIT_1_2, fault="kill_job:5@1", timeout_s=90)
    assert first.returncode == -9, (first.returncode, first.output[-3000:])  # torchrun itself was killed
    rows_before, kept = _last_checkpoint(run_dir, 4)
    assert rows_before == 5 and len(kept) == 8

    assert train_in_process(run_dir, "train.checkpoint_interval=2", resume=True) == 0
    _assert_exactly_once_over_runs(run_dir, rows_before, kept, 4)


DETERMINISTIC = ("pipeline.num_targets=1", "pipeline.deterministic=true", "train.grad_accum=1",
                 "train.checkpoint_interval=2")


def test_deterministic_resume_continues_the_uninterrupted_loss_curve(tmp_path):
    """Deterministic mode: 1 target + 1 drafter killed (whole job) after step 5, checkpoint at 4; resumed in
    one process. Steps 5.. after resume have the same jobs and losses as the uninterrupted run (replayed
    inline, which test_pipeline shows equals the pipeline): RNG is keyed by job and the optimizer, schedule
    and ledger come back from the checkpoint."""
    run_dir = tmp_path / "run"
    first = torchrun(run_dir, 2, "pipeline.colocated=false", *DETERMINISTIC, fault="kill_job:5@1", timeout_s=90)
    assert first.returncode == -9, first.output[-3000:]
    run1 = metrics(run_dir)
    rows_before = len(run1)
    assert train_in_process(run_dir, "pipeline.colocated=true", *DETERMINISTIC, resume=True) == 0

    plan = planned_jobs(run_dir)
    resumed = [r for r in metrics(run_dir) if r["step"] > 4]
    assert committed_jobs(resumed) == plan[4:]  # first in, first out, after the checkpoint's 4 jobs
    uninterrupted = inline_losses(run_dir, DETERMINISTIC, plan)
    got = torch.tensor([r["loss"] for r in resumed])
    want = torch.tensor(uninterrupted[4:])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    # run 1's steps before the kill were on the same curve too
    before = torch.tensor([r["loss"] for r in run1])
    assert torch.allclose(before, torch.tensor(uninterrupted[:rows_before]), rtol=1e-5, atol=1e-6)


def test_resume_follows_the_data_content_not_the_code_that_tokenized_it(tmp_path, monkeypatch, capsys):
    """New tokenizing code (another cache key) that yields the same sequences resumes; other sequences
    (another data.max_length) are refused with an error that names the data."""
    from dflash_trainer.data import tokenized

    run_dir, cache = tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}"
    assert train_in_process(run_dir, cache, "train.checkpoint_interval=2", "train.max_steps=2") == 0
    monkeypatch.setattr(tokenized, "CODE_VERSION", tokenized.CODE_VERSION + 1000)  # a new cache key
    assert train_in_process(run_dir, cache, "train.checkpoint_interval=2", "train.max_steps=4", resume=True) == 0
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # each entry's lock file beside it
    assert len(entries) == 2  # the data was tokenized again, under the new key
    assert [r["step"] for r in metrics(run_dir) if "jobs" in r] == [1, 2, 3, 4]
    capsys.readouterr()
    rc = train_in_process(run_dir, cache, "data.max_length=200", "train.max_steps=6", resume=True)
    assert rc == 2 and "data.max_length: 256 -> 200" in capsys.readouterr().err  # refused before any work
    # the checkpoint's own guard, for a config.yaml edited by hand (or data files changed in place)
    config_file = run_dir / "config.yaml"
    config_file.write_text(config_file.read_text().replace("max_length: 256", "max_length: 200"))
    rc = train_in_process(run_dir, cache, "data.max_length=200", "train.max_steps=6", resume=True)
    assert rc == 2 and "trained on other data" in capsys.readouterr().err


def test_a_resumed_run_keeps_its_best_drafter(tmp_path, monkeypatch):
    """Session 1 evaluates tau 1.679 (its drafter goes to best/); session 2, a new process on the same run dir,
    evaluates a worse 1.664: best/ keeps session 1's drafter and the summary names it; a better one replaces it."""
    import json
    from types import SimpleNamespace

    from dflash_trainer.config import load_config
    from dflash_trainer.train import tau_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    taus = iter([1.679, 1.664, 1.7])

    def evaluate(*args, **kwargs):
        tau = next(taus)
        return SimpleNamespace(tau=tau, greedy_match_rate=None, acceptance_histogram=[1], prompt_lookup_tau=None,
                               tau_stderr=None, prompts=1, seconds=0.0, to_json=lambda: {"tau": tau})

    monkeypatch.setattr(tau_eval, "evaluate_drafter", evaluate)
    config = load_config("demo", [f"run.dir={tmp_path}"])

    def session():
        return tau_eval.TauTracker(config, target=None, tokenizer=None, head=None, prompts_path=prompts,
                                   run_dir=tmp_path)

    def export_as(step):
        def export(out):
            out.mkdir(parents=True)
            (out / "drafter.txt").write_text(f"step {step}")
        return export

    model = torch.nn.Linear(1, 1)
    session().evaluate(model, 2, export=export_as(2))
    resumed = session()
    summary = resumed.evaluate(model, 4, export=export_as(4))
    assert (tmp_path / "best" / "drafter.txt").read_text() == "step 2"
    assert (summary.best_tau, summary.best_step, summary.tau) == (1.679, 2, 1.664)
    assert resumed.evaluate(model, 6, export=export_as(6)).best_step == 6
    assert (tmp_path / "best" / "drafter.txt").read_text() == "step 6"


def test_a_resume_does_not_read_its_warm_start_again(tmp_path):
    """A run started from another run's export (`drafter.init_from`) resumes after that export was deleted: the
    checkpoint holds the weights, so the warm start is not read again."""
    import shutil

    first, run_dir = tmp_path / "first", tmp_path / "run"
    assert train_in_process(first, "train.max_steps=2") == 0
    warm = (f"drafter.init_from={first / 'export'}", "train.checkpoint_interval=2")
    assert train_in_process(run_dir, *warm, "train.max_steps=2") == 0
    shutil.rmtree(first)
    assert train_in_process(run_dir, *warm, "train.max_steps=4", resume=True) == 0
    assert [r["step"] for r in metrics(run_dir) if "jobs" in r] == [1, 2, 3, 4]
