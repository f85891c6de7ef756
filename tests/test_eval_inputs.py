"""What `eval --drafter` and `export --checkpoint` take: a checkpoint evaluates as it is (the same tau as its export),
and a run dir given where a folder inside it is expected names the folders to pass."""

from __future__ import annotations

import json

from pipeline_helpers import train_in_process

from dflash_trainer.cli import main

EVAL = ("eval.num_prompts=3", "eval.max_new_tokens=12")


def test_a_checkpoint_evaluates_as_its_export_does_and_a_run_dir_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2", "train.checkpoint_interval=1") == 0
    ckpt = run / "checkpoints" / "step_2"
    capsys.readouterr()

    assert main(["eval", "--drafter", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--drafter {run} is a run directory" in err
    assert str(run / "export") in err and str(ckpt) in err  # what it holds, to pass instead
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {run} is a run directory" in err and str(ckpt) in err
    assert str(run / "export") not in err  # an export is no checkpoint

    assert main(["eval", "--drafter", str(ckpt), *EVAL]) == 0
    from_checkpoint = json.loads((run / "eval-step_2.json").read_text())
    exported = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(exported)]) == 0
    assert main(["eval", "--drafter", str(exported), "--config", str(run / "config.yaml"), "--out", str(exported),
                 *EVAL]) == 0
    from_export = json.loads((exported / "eval.json").read_text())
    assert from_checkpoint["per_prompt_committed"] == from_export["per_prompt_committed"]
    assert from_checkpoint["tau"] == from_export["tau"] and from_checkpoint["drafter"] == str(ckpt)


def test_the_demo_target_saved_as_the_verifier_of_a_speculators_export(tmp_path, capsys):
    """`export --format speculators --save-target DIR` on a random-init target (the demo's): DIR holds that very
    target (the weights the drafter was trained against, its tokenizer), and the export records DIR."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_trainer.config import load_config
    from dflash_trainer.target.load import load_target

    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=1") == 0
    saved, out = tmp_path / "demo-target", tmp_path / "spec"
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_1"), "--out", str(out),
                 "--format", "speculators", "--save-target", str(saved)]) == 0
    recorded = json.dumps(json.loads((out / "config.json").read_text()))
    assert json.dumps(str(saved.resolve())) in recorded
    config = load_config(str(run / "config.yaml"))
    trained_against = load_target(config.target, "cpu", seed=config.run.seed).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    assert set(reloaded) >= set(trained_against)
    assert all(torch.equal(reloaded[k].float(), v.float()) for k, v in trained_against.items())
    assert (saved / "tokenizer_config.json").is_file()
    capsys.readouterr()
    # the DFlash format records no target, but --save-target writes the one to serve it with (the demo's has no folder)
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_1"), "--out", str(tmp_path / "x"),
                 "--save-target", str(tmp_path / "t2")]) == 0
    assert f"vllm serve {(tmp_path / 't2').resolve()} --speculative-config" in capsys.readouterr().out
    assert (tmp_path / "t2" / "config.json").is_file()
