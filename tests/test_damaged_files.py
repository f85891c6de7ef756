"""Files we wrote, damaged before they are read back (issue 52, class 3): a flipped byte, a cut file, a byte that
is not UTF-8, a garbage line. Each reader finds the damage and names the file and what to do (or, where the file
is a copy it can make again, rebuilds it with a warning): never a `UnicodeDecodeError` or `JSONDecodeError`
traceback, never silent use of damaged data."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.config import load_config
from dflash_trainer.data.plan import build_epoch_plan, read_epoch_plan, read_eval_conversations, write_epoch_plan
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.data.shard_files import read_rows
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.report.runlog import read_run
from dflash_trainer.rundir import RunDir, claim_run_dir
from dflash_trainer.runtime.elastic import recorded_restarts
from dflash_trainer.runtime.summary import write_failed_summary
from dflash_trainer.train.checkpoint import (
    CheckpointState,
    checkpoint_problem,
    read_ledger,
    read_state,
    resolve_resume,
    save_checkpoint,
)
from dflash_trainer.train.metrics import read_metrics

# ------------------------------------------------------------------------------------------- tokenized cache


def _small_config(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question number {i}?"},
                          {"role": "assistant", "content": " ".join(["a long and careful reply"] * (4 + i % 5))}]}
            for i in range(24)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config("demo", [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
                                f"run.dir={tmp_path / 'run'}", "data.num_eval_conversations=3",
                                "data.max_conversations=null"])


def _safetensors_span(path: Path, name: str) -> tuple[int, int]:
    """The byte range of tensor `name`'s data inside a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


@pytest.fixture()
def cached(tmp_path, tiny_tokenizer):
    """A config and its first preparation (which wrote the tokenized cache)."""
    cfg = _small_config(tmp_path)
    first = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert not first.summary.cache_hit
    return cfg, first


@pytest.mark.parametrize("how", ["tensor", "raw byte"])
def test_a_flipped_token_id_in_the_cache_is_found_and_the_cache_rebuilt(cached, tmp_path, tiny_tokenizer, caplog,
                                                                         how):
    """A token id changed between `plan` and `train` (rewritten as a valid file, or one byte flipped on disk) is
    a checksum mismatch: the cache is rebuilt from the sources with a warning naming the file, and training gets
    the true ids (before: the changed ids, silently)."""
    cfg, first = cached
    data = Path(first.summary.cache_path) / "data.safetensors"
    if how == "tensor":
        tensors = load_file(str(data))
        tensors["input_ids"][5] += 1
        save_file(tensors, str(data))
    else:
        start, _ = _safetensors_span(data, "input_ids")
        raw = bytearray(data.read_bytes())
        raw[start + 4 * 5] ^= 0x01
        data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    warned = [r.getMessage() for r in caplog.records if "damaged (checksum mismatch" in r.getMessage()]
    assert warned and str(data) in warned[0] and "rebuilding" in warned[0], caplog.text
    assert not again.summary.cache_hit
    assert torch.equal(again.train.input_ids, first.train.input_ids)
    assert again.summary.content_sha256 == first.summary.content_sha256
    caplog.clear()
    third = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)  # the rebuilt cache is good again
    assert third.summary.cache_hit and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_changed_held_out_conversation_in_the_cache_meta_is_found(cached, tmp_path, tiny_tokenizer, caplog):
    """meta.json holds the held-out conversations and the counts: an edit there is found too."""
    cfg, first = cached
    meta_path = Path(first.summary.cache_path) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["eval"][0]["messages"][0]["content"] = "something else"
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert any(str(meta_path) in r.getMessage() and "checksum mismatch" in r.getMessage() for r in caplog.records)
    assert not again.summary.cache_hit and again.eval_conversations == first.eval_conversations


def test_a_cut_cache_meta_is_rebuilt_with_a_warning(cached, tmp_path, tiny_tokenizer, caplog):
    cfg, first = cached
    meta_path = Path(first.summary.cache_path) / "meta.json"
    meta_path.write_bytes(meta_path.read_bytes()[:50] + b"\xff")
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert any("unreadable" in r.getMessage() and first.summary.cache_path in r.getMessage() for r in caplog.records)
    assert not again.summary.cache_hit and again.train.lengths == first.train.lengths


# ----------------------------------------------------------------------------------------------- metrics.jsonl


def _row(step: int) -> bytes:
    return json.dumps({"step": step, "loss": 1.0 / step, "acc": 0.5}).encode() + b"\n"


def test_metrics_with_a_non_utf8_byte_and_a_garbage_line_leave_out_those_lines_with_a_count(tmp_path, caplog):
    """Damaged lines are left out and counted in one warning naming the file and the first line; the cut last
    line of a killed run is left out without a warning (before: UnicodeDecodeError)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_row(1) + _row(2) + _row(3).replace(b"0.5", b"0.\xff") + b"{{garbage\n" + _row(4)
                     + _row(5)[:15])
    with caplog.at_level(logging.INFO):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 damaged lines" in warnings[0] and str(path) in warnings[0], warnings
    assert "first is line 3" in warnings[0]


def test_a_cut_last_metrics_line_is_normal(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_row(1) + _row(2)[:9])
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(path)] == [1]
    assert not caplog.records


def test_report_reads_a_run_whose_files_are_damaged(tmp_path, caplog):
    """`report`'s reader: a non-UTF-8 config.yaml, a cut summary.json, a non-JSON eval.json and a damaged metrics
    line are each left out with a warning naming the file; the rest is read (before: UnicodeDecodeError)."""
    run = tmp_path / "run"
    run.mkdir()
    layout = RunDir(run)
    layout.metrics.write_bytes(_row(1) + b"\xfe\xff\n" + _row(2))
    layout.config.write_bytes(b"run:\n  name: caf\xe9\n")
    layout.summary.write_text('{"status": "ok", "steps": 2')
    layout.eval_json.write_text("[1, 2]")
    with caplog.at_level(logging.WARNING):
        log = read_run(run)
    assert [r["step"] for r in log.steps] == [1, 2]
    assert log.config == {} and log.summary == {} and log.last_eval is None
    text = caplog.text
    for path in (layout.metrics, layout.config, layout.summary, layout.eval_json):
        assert str(path) in text, (path, text)


# ------------------------------------------------------------------------------------------ run dir's plan files


def _plan(run):
    plan = build_epoch_plan([40, 50, 60, 70] * 5, epoch=0, seed=0, num_buckets=2, token_budget=256, max_seqs=8)
    write_epoch_plan(run, plan)
    return RunDir(run).epoch_plan(0)


@pytest.mark.parametrize("damage, problem", [
    (lambda b: b[: len(b) // 2], "cut short"),
    (lambda b: b[:20] + b"\xff" + b[21:], "byte 0xff at offset 20 is not UTF-8"),
    (lambda b: b'{"epoch": 0}', "not the plan we write"),
])
def test_a_damaged_epoch_plan_is_a_data_error_naming_it_and_the_fix(tmp_path, damage, problem):
    path = _plan(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as caught:
        read_epoch_plan(tmp_path, 0)
    message = str(caught.value)
    assert f"epoch plan {path} is damaged" in message and problem in message and "delete it" in message, message


def test_a_damaged_held_out_line_names_the_file_and_line(tmp_path):
    path = RunDir(tmp_path).eval_conversations
    path.parent.mkdir(parents=True)
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}], "source": "a", "source_index": 0})
    path.write_text(good + "\n" + good[:30] + "\n")
    with pytest.raises(DataError, match=rf"{path}:2 is damaged \(it ends mid-value: cut short\): delete it"):
        read_eval_conversations(tmp_path)
    path.write_bytes(good.encode() + b"\n\x80\n")
    with pytest.raises(DataError, match=r"byte 0x80 at offset \d+ is not UTF-8"):
        read_eval_conversations(tmp_path)


# ------------------------------------------------------------------------------------------------- checkpoints


def _save(run, step):
    state = CheckpointState(step=step, epoch=0, ledger={0: [1, 2]}, model_signature={"hidden": 8},
                            data_fingerprint="fp", scheduler={}, extra={})
    model = torch.nn.Linear(2, 2)
    return save_checkpoint(run, state, dict(model.state_dict()), {}, keep_last=3)


def test_a_non_utf8_complete_marker_is_skipped_for_the_checkpoint_before(tmp_path, caplog):
    older, newest = _save(tmp_path, 10), _save(tmp_path, 20)
    (newest / "COMPLETE").write_bytes(b'{"files": \x9c}')
    assert "not UTF-8" in checkpoint_problem(newest)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(tmp_path, "latest") == older
    assert any("step_20" in r.getMessage() and "COMPLETE" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="damaged.*COMPLETE"):
        resolve_resume(tmp_path, str(newest))


@pytest.mark.parametrize("marker", [b'{"files": {"state.json": 3}}', b'{"files": ["state.json"]}',
                                    b'{"files": {"state.json": {"bytes": 1'])
def test_a_complete_marker_that_is_not_ours_is_damage(tmp_path, marker):
    path = _save(tmp_path, 10)
    (path / "COMPLETE").write_bytes(marker)
    assert "COMPLETE file is unreadable" in checkpoint_problem(path)


@pytest.mark.parametrize("cut", [b'{"step": 20, "epoch": 0, "ledg', b'{"step": 20}', b"\xff\xfe"])
def test_damaged_checkpoint_state_of_an_unchecked_checkpoint_falls_back_and_names_the_file(tmp_path, caplog, cut):
    """A legacy checkpoint (no checksums) whose state.json is cut or damaged: `latest` falls back to the one
    before it with a warning; reading it directly is a ConfigError naming the file and the fix (before:
    JSONDecodeError / KeyError / UnicodeDecodeError when the ledger was read)."""
    older, newest = _save(tmp_path, 10), _save(tmp_path, 20)
    (newest / "COMPLETE").write_text("ok\n")  # the legacy marker: nothing checksummed
    (newest / "state.json").write_bytes(cut)
    assert "state.json is damaged" in checkpoint_problem(newest)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(tmp_path, "latest") == older
    with pytest.raises(ConfigError) as caught:
        read_ledger(newest)
    message = str(caught.value)
    assert f"checkpoint state {newest / 'state.json'} is damaged" in message
    assert f"delete {newest} and resume from the checkpoint before it" in message
    assert read_state(older)["step"] == 10


# --------------------------------------------------------------------------------------- other run-dir files


def test_regenerate_shard_with_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    row = json.dumps({"messages": [], "id": "a:0"}).encode()
    (tmp_path / "shard_00000.jsonl").write_bytes(row + b"\n" + row.replace(b"a:0", b"a:\xc31") + b"\n")
    with pytest.raises(DataError, match=r"shard_00000.jsonl:2: byte 0xc3 .* not UTF-8.*damaged"):
        list(read_rows(tmp_path))


def test_a_damaged_summary_does_not_stop_the_failure_summary(tmp_path):
    """write_failed_summary(keep_existing=True) over a damaged summary.json writes the failure (before: the
    decoding error was swallowed with the write, and the run's failure went unrecorded)."""
    RunDir(tmp_path).summary.write_bytes(b'{"status": "ok\xff')
    write_failed_summary(tmp_path, 1, "boom", keep_existing=True)
    assert json.loads(RunDir(tmp_path).summary.read_text())["cause"] == "boom"


def test_a_damaged_restart_record_is_named(tmp_path, caplog):
    RunDir(tmp_path).restarts.write_bytes(b'{"incarnation": 2, "earl')
    with caplog.at_level(logging.WARNING):
        assert recorded_restarts(tmp_path) == {"count": 0, "earlier": []}
    assert str(RunDir(tmp_path).restarts) in caplog.text


def test_a_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}: byte 0xe9 at offset 16 is not UTF-8 text; fix the file"):
        load_config(str(path))


def test_resume_into_a_run_whose_config_is_not_utf8_puts_it_back_as_it_was(tmp_path):
    run = tmp_path / "run"
    claim_run_dir(load_config("demo", [f"run.dir={run}"]), "train").release()
    damaged = b"run:\n  name: caf\xe9\n"
    RunDir(run).config.write_bytes(damaged)
    claim = claim_run_dir(load_config("demo", [f"run.dir={run}", "train.resume=latest"]), "train")
    try:
        assert RunDir(run).config.read_bytes() != damaged
        claim.restore_config()
        assert RunDir(run).config.read_bytes() == damaged
    finally:
        claim.release()


def test_a_damaged_summary_on_resume_is_warned_about_and_the_run_resumed(tmp_path, caplog):
    """A run whose summary.json is damaged is taken as not finished (a resume trains what is left, and its summary
    replaces the damaged one), with a warning naming the file, not silently."""
    from dflash_trainer.runtime.setup import _finished

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_bytes(b'{"status": "o\xff')
    with caplog.at_level(logging.WARNING):
        assert _finished(load_config("demo", []), run, run / "checkpoints" / "step_1", ()) is False
    assert f"{run / 'summary.json'} cannot be read" in caplog.text and "taken as not finished" in caplog.text
    (run / "summary.json").unlink()
    caplog.clear()
    assert _finished(load_config("demo", []), run, run / "checkpoints" / "step_1", ()) is False
    assert "cannot be read" not in caplog.text  # no summary yet: nothing to warn about


def test_a_run_config_cut_at_a_line_boundary_is_named_and_a_whole_or_edited_one_loads(tmp_path):
    """A run's config.yaml cut after a whole line still parses, and the settings past the cut would take their
    defaults (a silently different run on resume): its missing end line names it. An edited one that keeps its
    last line, and a recipe written by hand (no first line), load as ever."""
    from dflash_trainer.config import RUN_CONFIG_END
    from dflash_trainer.rundir import save_config

    config = load_config("demo", ["train.lr=1.5e-3", "logging.progress=false"])
    path = save_config(config, tmp_path / "run")
    assert load_config(path).train.lr == 1.5e-3  # whole: loads as written
    text = path.read_text()
    assert text.rstrip().endswith(RUN_CONFIG_END)
    lines = text.splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.startswith("train:"))  # the train section and all after
    path.write_text("".join(lines[:cut]))
    with pytest.raises(ConfigError, match=r"config.yaml: cut short: a run's config.yaml ends with the line"):
        load_config(path)
    path.write_text(text.replace("lr: 0.0015", "lr: 0.002"))  # a hand edit that keeps the end line
    assert load_config(path).train.lr == 0.002
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("target:\n  random_init: tiny\ntrain:\n  lr: 0.003\n")  # the user's own recipe: no check
    assert load_config(recipe).train.lr == 0.003
