"""Evaluation with a real DFlash drafter: lossless speculative decoding, tau accounting, `dflash-train eval`."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re

import pytest
import torch

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.drafter_eval import eval_prompts_path
from dflash_trainer.eval.evaluate import GREEDY_MISMATCH_NOTE, evaluate_tau, format_report, setting_digest
from dflash_trainer.eval.stats import tau_difference_stderr, tau_stderr
from dflash_trainer.eval.speculative import speculative_generate, target_generate
from dflash_trainer.target.presets import preset_config
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)
from tests.eval_helpers import batch_proposer_for, fitted, proposer_for

MESSAGES = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 5?"},
     {"role": "assistant", "content": "8, dropped: eval prompts end at the last user turn"}],
    [{"role": "user", "content": "List three colours."}],
]


def _spec_and_plain(target, drafter, prompt, *, block_size, max_new=24, stop=()):
    out = speculative_generate(target, proposer_for(drafter, target), prompt, block_size=block_size,
                               tap_layer_ids=drafter.spec.tap_layer_ids, max_new_tokens=max_new, stop_token_ids=stop)
    ref = target_generate(target, prompt, max_new_tokens=max_new, stop_token_ids=stop)
    return out, ref


@pytest.mark.parametrize("trained", [False, True])
def test_speculative_output_equals_greedy_target_output(trained):
    """The lossless property, with a random drafter (acceptance ~1) and a partly fitted one (long accepts)."""
    setup = fitted()
    drafter = setup.drafter if trained else tiny_drafter(seed=3)[0]
    lengths = []
    for i, prompt in enumerate(setup.prompts):
        out, ref = _spec_and_plain(setup.target, drafter, prompt, block_size=4, max_new=21 + i)
        assert out.output_ids == ref.output_ids
        assert len(out.output_ids) == 21 + i and sum(out.acceptance_lengths) == len(out.output_ids) - 1
        assert all(1 <= n <= 4 for n in out.acceptance_lengths)
        lengths += out.acceptance_lengths
    if trained:  # the fitted drafter is right often enough that every acceptance length occurs
        assert set(lengths) == {1, 2, 3, 4}


def test_speculative_stops_at_stop_token_like_plain_decoding():
    setup = fitted()
    prompt = setup.prompts[2]
    free = target_generate(setup.target, prompt, max_new_tokens=30, stop_token_ids=[]).output_ids
    stop = free[12]
    out, ref = _spec_and_plain(setup.target, setup.drafter, prompt, block_size=4, max_new=30, stop=[stop])
    assert out.output_ids == ref.output_ids == free[: free.index(stop) + 1]
    assert out.stop_reason == ref.stop_reason == "eos"


def test_evaluate_tau_histogram_and_formula():
    setup = fitted()
    taps = setup.drafter.spec.tap_layer_ids
    make = lambda: batch_proposer_for(setup.drafter, setup.target)  # noqa: E731
    report = evaluate_tau(setup.target, make, setup.prompts, block_size=4, tap_layer_ids=taps, max_new_tokens=20,
                          stop_token_ids=[], batch_size=3)  # two batches
    proposer = proposer_for(setup.drafter, setup.target)
    per_prompt = [speculative_generate(setup.target, proposer, p, block_size=4, tap_layer_ids=taps,
                                       max_new_tokens=20, stop_token_ids=[]).acceptance_lengths for p in setup.prompts]
    all_lengths = [n for lengths in per_prompt for n in lengths]
    assert report.acceptance_histogram == [all_lengths.count(k) for k in range(1, 5)]
    assert sum(report.acceptance_histogram) == report.steps == len(all_lengths)
    committed = sum(k * c for k, c in enumerate(report.acceptance_histogram, 1))
    assert report.tau == pytest.approx(committed / report.steps)
    assert 1.2 < report.tau <= 4  # the fitted drafter is accepted beyond the bonus token
    assert report.tokens_generated == 4 * 20 == committed + report.prompts  # + the prefill's token per prompt
    assert report.greedy_match_rate == 1.0 and report.target_tokens_per_s > 0 and report.speculative_tokens_per_s > 0
    lookup = sum(k * c for k, c in enumerate(report.prompt_lookup_histogram, 1))
    assert lookup == committed and report.prompt_lookup_tau == pytest.approx(lookup / sum(report.prompt_lookup_histogram))
    sampled = evaluate_tau(setup.target, make, setup.prompts[:2], block_size=4, max_new_tokens=10,
                           tap_layer_ids=taps, stop_token_ids=[], temperature=0.8, with_prompt_lookup=False)
    assert sampled.greedy_match_rate is None and sampled.tokens_generated == 20 and sampled.prompt_lookup_tau is None
    assert sum(k * c for k, c in enumerate(sampled.acceptance_histogram, 1)) == 20 - 2
    assert GREEDY_MISMATCH_NOTE not in format_report(report)  # every output matched
    assert GREEDY_MISMATCH_NOTE in format_report(dataclasses.replace(report, greedy_match_rate=0.5))
    assert 0 < report.tau_stderr < 1 and report.prompt_lookup_tau_stderr is not None
    assert report.per_prompt_steps == [len(lengths) for lengths in per_prompt]
    assert report.per_prompt_committed == [sum(lengths) for lengths in per_prompt]
    lookup_counts = (report.prompt_lookup_per_prompt_committed, report.prompt_lookup_per_prompt_steps)
    assert len(lookup_counts[1]) == len(setup.prompts) and sum(lookup_counts[1]) == sum(report.prompt_lookup_histogram)
    assert sum(lookup_counts[0]) / sum(lookup_counts[1]) == pytest.approx(report.prompt_lookup_tau)
    # the digest names what the evaluation ran on: the same again gives the same, any change another
    again = evaluate_tau(setup.target, make, setup.prompts, block_size=4, tap_layer_ids=taps, max_new_tokens=20,
                         stop_token_ids=[], batch_size=3, with_baseline=False, with_prompt_lookup=False)
    assert len(report.setting_digest) == 64 and again.setting_digest == report.setting_digest
    others = [evaluate_tau(setup.target, make, setup.prompts[:3], block_size=4, tap_layer_ids=taps, max_new_tokens=20,
                           stop_token_ids=[], with_baseline=False, with_prompt_lookup=False),
              evaluate_tau(setup.target, make, setup.prompts, block_size=4, tap_layer_ids=taps, max_new_tokens=19,
                           stop_token_ids=[], with_baseline=False, with_prompt_lookup=False),
              evaluate_tau(setup.target, make, setup.prompts, block_size=4, tap_layer_ids=taps, max_new_tokens=20,
                           stop_token_ids=[], temperature=0.5, with_baseline=False, with_prompt_lookup=False)]
    assert len({report.setting_digest, *(o.setting_digest for o in others)}) == 4
    # the target's weights: the same layer in another dtype (an FP8 target's weights are another tensor type),
    # other values of the same shapes; not where it was read from (a copy of the same weights)
    layer = torch.nn.Linear(2, 2)
    fp32 = setting_digest(layer, setup.prompts)
    assert setting_digest(copy.deepcopy(layer), setup.prompts) == fp32
    assert setting_digest(torch.nn.Linear(2, 2), setup.prompts) != fp32  # other random weights
    bf16 = setting_digest(copy.deepcopy(layer).to(torch.bfloat16), setup.prompts)
    assert bf16 != fp32 and bf16 == setting_digest(layer.to(torch.bfloat16), setup.prompts)
    assert f"± {report.tau_stderr:.3f} (standard error over prompts)" in format_report(report)


def test_tau_stderr_treats_prompts_as_the_sampled_units():
    # unequal steps, by hand: committed 2, 12, 7 over steps 1, 6, 2: tau = 21/9 = 7/3, and each prompt's term
    # (committed - tau * steps) / 9 = (-1/3, -2, 7/3) / 9
    terms = [(-1 / 3) / 9, -2 / 9, (7 / 3) / 9]
    assert tau_stderr([2, 12, 7], [1, 6, 2]) == pytest.approx((sum(t * t for t in terms) * 3 / 2) ** 0.5)
    with pytest.raises(ValueError, match="got 3 and 2"):
        tau_stderr([1, 2, 3], [1, 1])
    # equal steps per prompt: the standard error of the mean of the per-prompt taus 1 and 3 (sd sqrt(2), n 2)
    assert tau_stderr([2, 6], [2, 2]) == pytest.approx(1.0)
    # many steps do not shrink it when the prompts disagree: 2 prompts are 2 samples
    assert tau_stderr([50, 150], [50, 50]) == pytest.approx(1.0)
    assert tau_stderr([6, 12], [2, 4]) == pytest.approx(0.0)  # every prompt has tau 3
    assert tau_stderr([6], [2]) is None and tau_stderr([0, 0], [0, 0]) is None


def test_tau_difference_on_the_same_prompts_removes_what_the_prompts_share():
    easy_hard = ([40, 10], [10, 10])  # taus 4 and 1: a large error alone
    shifted = ([45, 15], [10, 10])  # the same prompts, each +0.5
    assert tau_stderr(*easy_hard) == pytest.approx(1.5)
    assert tau_difference_stderr(*shifted, *easy_hard) == pytest.approx(0.0)  # the gain is the same on both
    # a reference: the standard error of the mean of per-prompt differences, for equal steps per prompt
    a, b = ([30, 20, 50, 10], [10] * 4), ([25, 22, 41, 10], [10] * 4)
    diffs = [(x - y) / 10 for x, y in zip(a[0], b[0])]
    mean = sum(diffs) / 4
    reference = (sum((d - mean) ** 2 for d in diffs) / 3 / 4) ** 0.5
    assert tau_difference_stderr(*a, *b) == pytest.approx(reference)
    with pytest.raises(ValueError, match="same prompts: 4 against 2"):
        tau_difference_stderr(*a, *easy_hard)


def _tiny_config(tmp_path, *overrides):
    return load_config(None, ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32",
                              "run.device=cpu", f"run.dir={tmp_path / 'run'}", "eval.num_prompts=2",
                              "eval.max_new_tokens=10", "data.max_length=64", *overrides])


def _export_for(path, **spec_changes):
    """A random 1-layer drafter export for the tiny target, with `spec_changes` (e.g. another hidden size)."""
    target_config = preset_config("tiny")
    config = DrafterConfig(num_layers=1, block_size=4, gamma=2.0, tap_layer_ids=[1, 3])
    spec = drafter_spec(target_config, config, mask_token_id=target_config.vocab_size - 1)
    return export_drafter(DFlashDrafter(dataclasses.replace(spec, **spec_changes)), path)


def _write_prompts(path, rows=MESSAGES):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))


def test_eval_command_end_to_end(tmp_path, capsys, caplog):
    export = _export_for(tmp_path / "export")
    _write_prompts(tmp_path / "run" / "plan" / "eval.jsonl")  # the default prompts: RUN_DIR/plan/eval.jsonl
    data_dir = tmp_path / "regen"
    data_dir.mkdir()
    (data_dir / "manifest.json").write_text(json.dumps({"settings": {"thinking": True, "temperature": 0.0},
                                                        "complete": True}))
    with caplog.at_level(logging.WARNING):
        rc = cli.main(["eval", "--drafter", str(export), "target.random_init=tiny", "target.tokenizer=tiny",
                       "target.dtype=float32", "run.device=cpu", f"run.dir={tmp_path / 'run'}", "eval.num_prompts=2",
                       "eval.max_new_tokens=10", "data.max_length=64", f"data.path={data_dir}"])
    assert rc == 0
    assert any("thinking=on" in r.getMessage() for r in caplog.records)  # data regenerated with thinking on
    printed = capsys.readouterr().out
    assert "tau" in printed and "acceptance histogram" in printed and "greedy match rate" in printed
    result = json.loads((tmp_path / "run" / "eval-export.json").read_text())  # beside a training's eval.json
    for key in ("tau", "acceptance_histogram", "prompts", "tokens_generated", "block_size", "temperature",
                "target_tokens_per_s", "speculative_tokens_per_s", "greedy_match_rate", "note", "drafter",
                "max_new_tokens"):
        assert key in result, key
    assert result["prompts"] == 2 and result["block_size"] == 4 and result["max_new_tokens"] == 10
    assert result["temperature"] == 0.0 and result["greedy_match_rate"] == 1.0 and result["drafter"] == str(export)
    assert len(result["acceptance_histogram"]) == 4 and sum(result["acceptance_histogram"]) == result["steps"]
    committed = sum(k * c for k, c in enumerate(result["acceptance_histogram"], 1))
    assert result["tau"] == pytest.approx(committed / result["steps"])
    assert result["tokens_generated"] == committed + 2 <= 20
    assert result["prompts_path"] == str(tmp_path / "run" / "plan" / "eval.jsonl")

    out_dir = tmp_path / "elsewhere"
    _write_prompts(tmp_path / "p.jsonl", MESSAGES[:1])
    config = _tiny_config(tmp_path, f"eval.prompts={tmp_path / 'p.jsonl'}", "eval.max_new_tokens=6")
    from dflash_trainer.commands import eval as eval_command

    args = cli._parser().parse_args(["eval", "--drafter", str(export), "--out", str(out_dir)])
    assert eval_command.run(config, args) == 0
    result = json.loads((out_dir / "eval.json").read_text())
    assert result["prompts"] == 1 and result["tokens_generated"] <= 6
    run_dir = tmp_path / "training"  # --out a run dir that has no eval.json yet (still training): beside it still
    run_dir.mkdir()
    (run_dir / ".dflash-run").write_text("{}")
    args = cli._parser().parse_args(["eval", "--drafter", str(export), "--out", str(run_dir)])
    assert eval_command.run(config, args) == 0
    assert (run_dir / "eval-export.json").is_file() and not (run_dir / "eval.json").exists()


def test_eval_command_verifies_a_dspark_export_one_token_wider_than_its_block(tmp_path):
    """A DSpark export (ModelOpt's `projector_type: dspark`) drafts from every slot of its block of 4: each step
    verifies 5 tokens, so its histogram has 5 entries and its tau counts them."""
    export = _export_for(tmp_path / "export", variant="dspark", markov_rank=8)
    _write_prompts(tmp_path / "p.jsonl")
    config = _tiny_config(tmp_path, f"eval.prompts={tmp_path / 'p.jsonl'}")
    from dflash_trainer.commands import eval as eval_command

    args = cli._parser().parse_args(["eval", "--drafter", str(export), "--out", str(tmp_path / "out")])
    assert eval_command.run(config, args) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["block_size"] == 5 and len(result["acceptance_histogram"]) == 5
    committed = sum(k * c for k, c in enumerate(result["acceptance_histogram"], 1))
    assert result["tau"] == pytest.approx(committed / result["steps"]) and result["greedy_match_rate"] == 1.0


def test_prompts_path_errors(tmp_path, capsys):
    config = load_config(None, ["target.random_init=tiny", "target.tokenizer=tiny"])
    with pytest.raises(ConfigError, match=r"eval\.prompts.*run\.dir is not set"):
        eval_prompts_path(config)
    config = _tiny_config(tmp_path)
    with pytest.raises(ConfigError, match=r"eval\.prompts is not set and .*plan/eval\.jsonl does not exist"):
        eval_prompts_path(config)
    export = _export_for(tmp_path / "export")
    rc = cli.main(["eval", "--drafter", str(export), f"eval.prompts={tmp_path / 'missing.jsonl'}",
                   "target.random_init=tiny", "target.tokenizer=tiny", f"run.dir={tmp_path}"])
    assert rc == 2 and "missing.jsonl not found" in capsys.readouterr().err
    rc = cli.main(["eval", "target.random_init=tiny", "target.tokenizer=tiny"])
    assert rc == 2 and "needs --drafter" in capsys.readouterr().err
    for argv, needs in ((["eval"], "needs --drafter DIR"), (["export", "--out", "o"], "needs --checkpoint"),
                        (["export"], "needs --checkpoint CHECKPOINT_DIR (RUN_DIR/checkpoints/step_N) and --out DIR")):
        assert cli.main(argv) == 2  # no config at all: the missing option is named, not target.path
        err = capsys.readouterr().err
        assert needs in err and "target.path" not in err, err


def test_mismatched_drafter_errors(tmp_path, capsys):
    _write_prompts(tmp_path / "p.jsonl")
    base = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            f"eval.prompts={tmp_path / 'p.jsonl'}", f"run.dir={tmp_path / 'run'}"]
    cases = {  # exports built for other targets
        "hidden": (_export_for(tmp_path / "hidden", hidden_size=32, head_dim=8),
                   r"does not fit the target: drafter hidden size 32 != target hidden size 64"),
        "mask": (_export_for(tmp_path / "mask", vocab_size=5000, mask_token_id=4000),
                 r"mask_token_id 4000 is not a row of the target's embedding \(1088 rows\)"),
        "tap": (_export_for(tmp_path / "tap", num_target_layers=9, tap_layer_ids=(1, 5)),
                r"taps the target's last layer 5"),
    }
    for name, (export, message) in cases.items():
        assert cli.main(["eval", "--drafter", str(export), *base]) == 2, name
        err = capsys.readouterr().err
        assert str(export) in err
        assert re.search(message, err), (name, err)


def test_damaged_exports_bad_out_and_non_utf8_prompts_are_named_errors(tmp_path, capsys):
    _write_prompts(tmp_path / "p.jsonl")
    base = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            f"eval.prompts={tmp_path / 'p.jsonl'}", f"run.dir={tmp_path / 'run'}", "eval.num_prompts=1",
            "eval.max_new_tokens=4", "data.max_length=64", "logging.progress=false"]
    good = _export_for(tmp_path / "good")
    empty_config = _export_for(tmp_path / "empty_config")
    (empty_config / "config.json").write_text("")
    list_config = _export_for(tmp_path / "list_config")
    (list_config / "config.json").write_text("[1, 2]")
    cut = _export_for(tmp_path / "cut")
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:100])
    cases = [
        (["--drafter", str(empty_config)], r"empty_config/config.json is not a drafter export config \(it ends mid-value: cut short\)"),
        (["--drafter", str(list_config)], r"list_config/config.json is not a drafter export config .*a JSON list"),
        (["--drafter", str(cut)], r"cut/model.safetensors is unreadable .*cut short or damaged"),
        (["--drafter", str(good), "--out", str(tmp_path / "p.jsonl")], r"--out .*p.jsonl is a file"),
    ]
    for args, message in cases:
        assert cli.main(["eval", *args, *base]) == 2, args
        assert re.search(message, capsys.readouterr().err), args
    (tmp_path / "latin1.jsonl").write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    assert cli.main(["eval", "--drafter", str(good), *base, f"eval.prompts={tmp_path / 'latin1.jsonl'}"]) == 2
    assert "latin1.jsonl is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("content", [123, [{"type": "image_url"}], None], ids=["number", "list", "null"])
def test_a_prompt_whose_content_is_not_text_is_named(tmp_path, content):
    from dflash_trainer.errors import DataError
    from dflash_trainer.eval.evaluate import load_prompt_messages

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "fine"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": content}]}) + "\n")
    with pytest.raises(DataError, match=rf"p\.jsonl:2: a user turn's content is {type(content).__name__}, not text"):
        load_prompt_messages(path, 8)
