"""Real tau during a split run (1 target + 1 drafter, gloo): the first target rank evaluates the drafters
the leader sends it between jobs, the leader logs the results and the best drafter by tau is kept."""

import json

from pipeline_helpers import assert_ok, committed_jobs, metrics, planned_jobs, torchrun


def test_split_run_measures_tau_on_the_target_rank(tmp_path):
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 2, "pipeline.colocated=false", "pipeline.num_targets=1", "eval.interval=4",
                      "eval.at_end=true", "eval.num_prompts=2", "eval.max_new_tokens=16")
    summary = assert_ok(launch)
    rows = metrics(run_dir)
    evals = [r for r in rows if "eval_tau" in r]
    steps = summary["steps"]
    assert [r["step"] for r in evals] == sorted({*range(4, steps + 1, 4), steps}), evals
    assert all(r["eval_tau"] >= 1.0 for r in evals)
    # beside real tau: prompt lookup on the same prompts, and the held-out validation on their replies
    assert all(r["eval_prompt_lookup_tau"] >= 1.0 and r["val_walk_tau"] >= 1.0 and r["val_loss"] > 0 for r in evals)
    assert summary["eval"]["val"]["walk_tau"] == evals[-1]["val_walk_tau"]
    assert sorted(committed_jobs([r for r in rows if "jobs" in r])) == sorted(planned_jobs(run_dir))
    assert summary["eval"]["tau"] == evals[-1]["eval_tau"]
    best = json.loads((run_dir / "best" / "eval.json").read_text())
    assert best["tau"] == max(r["eval_tau"] for r in evals)
    assert (run_dir / "best" / "model.safetensors").is_file() and not (run_dir / ".eval").exists()
    # the target rank measured what this process measures on the same export: tokens and acceptance are exact
    assert _evaluate_here(run_dir, run_dir / "best") == (best["tau"], best["acceptance_histogram"])


def _evaluate_here(run_dir, export):
    import torch

    from dflash_trainer.config import load_config
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.drafter.export import load_drafter
    from dflash_trainer.eval.drafter_eval import evaluate_drafter
    from dflash_trainer.eval.evaluate import load_prompt_messages
    from dflash_trainer.target.head import head_from_model
    from dflash_trainer.target.load import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the torchrun ranks
    try:
        config = load_config(run_dir / "config.yaml")
        target = load_target(config.target, "cpu", seed=config.run.seed)
        prompts = load_prompt_messages(run_dir / "plan" / "eval.jsonl", config.eval.num_prompts)
        report = evaluate_drafter(config, target, load_tokenizer(config.target), load_drafter(export).eval(), prompts,
                                  head=head_from_model(target))
    finally:
        torch.set_num_threads(threads)
    return report.tau, report.acceptance_histogram
