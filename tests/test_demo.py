"""The demo recipe end to end on a shorter run: regenerate with the tiny target, train on its own answers,
export, measure real tau. The loss falls clearly and tau ends clearly above an untrained drafter's."""

import json

import torch

from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
from dflash_trainer.eval.drafter_eval import evaluate_drafter
from dflash_trainer.eval.evaluate import load_prompt_messages
from dflash_trainer.target.head import head_from_model
from dflash_trainer.target.load import load_target


def test_demo_loss_falls_and_tau_beats_untrained(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    common = ["logging.progress=false", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["regenerate", "--config", "demo", "--out", str(data), "data.max_conversations=300", *common]) == 0
    assert main(["train", "--config", "demo", f"data.path={data}", f"run.dir={run}", "train.num_epochs=3", *common]) == 0

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["jobs_duplicated"] == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]  # eval rows carry eval_tau instead
    first, last = losses[0], sum(losses[-10:]) / 10
    assert last < first - 0.5, f"loss did not fall clearly: first {first:.3f}, mean of last 10 {last:.3f}"

    config = load_config("demo", [f"run.dir={run}", f"data.path={data}"])
    target = load_target(config.target, "cpu", seed=config.run.seed)
    tokenizer = load_tokenizer(config.target)
    spec = drafter_spec(target.config, config.drafter, mask_token_id=first_spare_row(tokenizer))
    torch.manual_seed(config.run.seed)
    untrained = DFlashDrafter(spec, attention="sdpa")
    with torch.no_grad():
        untrained.init_weights()
    prompts = load_prompt_messages(run / "plan" / "eval.jsonl", config.eval.num_prompts)
    baseline = evaluate_drafter(config, target, tokenizer, untrained.eval(), prompts, head=head_from_model(target))
    trained = summary["eval"]["tau"]
    assert trained > baseline.tau + 0.1, f"trained tau {trained:.3f} vs untrained {baseline.tau:.3f}"
    assert (run / "export" / "model.safetensors").is_file() and (run / "best" / "config.json").is_file()
    # the held-out validation ran on the replies of the prompts real tau decoded, and was logged
    val = summary["eval"]["val"]
    assert val["replies"] == config.eval.num_prompts and val["anchors"] > val["walk_steps"] > 0
    last_eval = [r for r in rows if "val_walk_tau" in r][-1]
    assert last_eval["val_walk_tau"] == val["walk_tau"] and last_eval["eval_prompt_lookup_tau"] >= 1.0
