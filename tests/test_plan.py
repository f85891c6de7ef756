"""Bucketing, the epoch plan, the held-out slice, the tokenized cache, the run dir and `dflash-train plan`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.data import prepare as prepare_module
from dflash_trainer.data.bucketing import pack_in_order, padding_waste
from dflash_trainer.data.plan import (
    JOB_ID_STRIDE,
    build_epoch_plan,
    read_epoch_plan,
    read_eval_conversations,
    write_epoch_plan,
)
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.errors import ConfigError, DataError


def skewed_lengths(n=2000, seed=0) -> list[int]:
    """Mostly short sequences, a long tail (like chat data)."""
    rng = random.Random(seed)
    return [min(1024, max(16, int(rng.lognormvariate(5.0, 0.9)))) for _ in range(n)]


def plan_for(lengths, epoch=0, seed=0, **kw):
    args = dict(num_buckets=8, token_budget=2048, max_seqs=64) | kw
    return build_epoch_plan(lengths, epoch=epoch, seed=seed, **args)


def test_bucketed_packing_wastes_much_less_than_packing_in_arrival_order():
    lengths = skewed_lengths()
    plan = plan_for(lengths, max_seqs=128)
    naive = pack_in_order(random.Random(0).sample(range(len(lengths)), len(lengths)), lengths,
                          token_budget=2048, max_seqs=128)
    naive_waste = padding_waste(naive, lengths, 2048)
    assert plan.padding_waste < 0.02 and plan.padding_waste < naive_waste / 4, (plan.padding_waste, naive_waste)
    assert len(plan.jobs) < len(naive)


def test_plan_covers_every_sequence_once_within_budget():
    lengths = skewed_lengths()
    plan = plan_for(lengths, max_seqs=12)
    ids = [i for j in plan.jobs for i in j.sequence_ids]
    assert sorted(ids) == list(range(len(lengths)))
    for job in plan.jobs:
        assert job.num_tokens == sum(lengths[i] for i in job.sequence_ids) <= 2048
        assert len(job.sequence_ids) <= 12
        bucket = plan.buckets[job.bucket_id]  # labelled by its longest sequence; fillers are never longer
        assert bucket.min_length <= lengths[job.sequence_ids[0]] <= bucket.max_length
        assert all(lengths[i] <= bucket.max_length for i in job.sequence_ids)
    assert sum(b.num_jobs for b in plan.buckets) == len(plan.jobs)
    # buckets are interleaved, not one after another
    first = [j.bucket_id for j in plan.jobs[:20]]
    assert len(set(first)) > 2


def test_plan_is_deterministic_and_epochs_differ():
    lengths = skewed_lengths(500)
    assert plan_for(lengths, epoch=1) == plan_for(lengths, epoch=1)
    e0, e1 = plan_for(lengths, epoch=0), plan_for(lengths, epoch=1)
    assert [j.sequence_ids for j in e0.jobs] != [j.sequence_ids for j in e1.jobs]
    assert [j.job_id for j in e1.jobs] == [JOB_ID_STRIDE + k for k in range(len(e1.jobs))]
    assert not {j.job_id for j in e0.jobs} & {j.job_id for j in e1.jobs}


def test_plan_round_trips_through_the_run_dir(tmp_path):
    plan = plan_for(skewed_lengths(300), epoch=3)
    write_epoch_plan(tmp_path, plan)
    assert read_epoch_plan(tmp_path, 3) == plan
    with pytest.raises(DataError, match="no epoch plan"):
        read_epoch_plan(tmp_path, 4)


def test_sequence_longer_than_budget_names_both_keys():
    with pytest.raises(ConfigError, match=r"data\.max_length.*pipeline\.token_budget"):
        plan_for([100, 3000], token_budget=2048)


# -------------------------------------------------------------------------------- prepare_data + cache

WORDS = "the model answers every question with a long and careful reply about many things".split()


def reply(i: int, n: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def write_dataset(path, n=40):
    rows = [{"messages": [{"role": "user", "content": f"question number {i}?"},
                          {"role": "assistant", "content": reply(i, 10 + i % 30)}]} for i in range(n)]
    rows.append({"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "ok"}]})
    rows.append({"messages": [{"role": "user", "content": "nobody answers"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_config(tmp_path, *extra):
    data = write_dataset(tmp_path / "data.jsonl")
    return load_config("demo", [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
                                f"run.dir={tmp_path / 'run'}", "data.num_eval_conversations=5",
                                "data.max_conversations=null", *extra])


def test_prepare_holds_out_eval_and_counts_everything(tmp_path, tiny_tokenizer):
    cfg = small_config(tmp_path)
    prepared = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    s = prepared.summary
    assert s.eval_conversations == 5 and len(prepared.eval_conversations) == 5
    assert s.dropped == {"no_assistant_turn": 1, "too_few_supervised_tokens": 1}
    assert s.conversations_total == 42 == s.conversations_kept + s.eval_conversations + sum(s.dropped.values())
    assert s.truncated == 0 and s.truncated_tokens == 0
    full = {int(i): n for i, n in zip(prepared.train.source_index, prepared.train.lengths)}
    limit = sorted(full.values())[len(full) // 2]
    cut = prepare_data(small_config(tmp_path, f"data.max_length={limit}"), tmp_path / "run", tokenizer=tiny_tokenizer)
    kept = [int(i) for i in cut.train.source_index]  # the cut ones that still hold enough supervised tokens
    assert cut.summary.truncated == sum(full[i] > limit for i in kept) > 0
    assert cut.summary.truncated_tokens == sum(full[i] - limit for i in kept if full[i] > limit)
    assert read_eval_conversations(tmp_path / "run") == list(prepared.eval_conversations)
    # the held-out conversations never reach a job
    held = {c.source_index for c in prepared.eval_conversations}
    plan = build_epoch_plan(prepared.train.lengths, epoch=0, seed=0, num_buckets=4, token_budget=2048, max_seqs=32)
    planned = {int(prepared.train.source_index[i]) for j in plan.jobs for i in j.sequence_ids}
    assert planned and not planned & held
    assert len(planned) == s.conversations_kept
    seq = prepared.train[0]
    assert seq.input_ids.dtype.is_floating_point is False and seq.loss_mask.sum() >= 16


def test_cache_hit_skips_tokenizing_and_config_changes_invalidate(tmp_path, tiny_tokenizer, monkeypatch):
    cfg = small_config(tmp_path)
    first = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert not first.summary.cache_hit

    def boom(*a, **k):
        raise AssertionError("re-tokenized despite a valid cache")

    monkeypatch.setattr(prepare_module, "tokenize_all", boom)
    second = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert second.summary.cache_hit
    assert second.train.lengths == first.train.lengths
    assert second.eval_conversations == first.eval_conversations
    monkeypatch.undo()
    shorter = prepare_data(small_config(tmp_path, "data.max_length=64"), tmp_path / "run", tokenizer=tiny_tokenizer)
    assert not shorter.summary.cache_hit and max(shorter.train.lengths) == 64
    reseeded = prepare_data(small_config(tmp_path, "run.seed=7"), tmp_path / "run", tokenizer=tiny_tokenizer)
    assert not reseeded.summary.cache_hit


def test_processes_preparing_the_same_data_at_once_tokenize_it_once(tmp_path, tiny_tokenizer, monkeypatch):
    """Two preparations of the same data started together (a sweep's arms): one tokenizes while the other waits
    on the cache entry's lock, then reads the cache. A holder that does not let go is a DataError naming it."""
    import threading
    import time

    from dflash_trainer.data.tokenized import cache_lock

    cfg = small_config(tmp_path)
    real = prepare_module.tokenize_all
    calls = []

    def slow_tokenize_all(*a, **k):
        calls.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other thread to reach the lock
        return real(*a, **k)

    monkeypatch.setattr(prepare_module, "tokenize_all", slow_tokenize_all)
    results = {}

    def prepare(name):
        results[name] = prepare_data(cfg, tmp_path / f"run-{name}", tokenizer=tiny_tokenizer, write_files=False)

    threads = [threading.Thread(target=prepare, args=(n,), name=n) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and sorted(results) == ["a", "b"]
    assert len(calls) == 1 and sorted(r.summary.cache_hit for r in results.values()) == [False, True]
    assert results["a"].train.lengths == results["b"].train.lengths
    entry = Path(results["a"].summary.cache_path)
    with cache_lock(entry):
        with pytest.raises(DataError, match=f"{entry.name}.lock.*data.cache_dir"):
            with cache_lock(entry, timeout_s=0.2, poll_s=0.05):
                pass
    with cache_lock(entry, timeout_s=0.2):  # released on exit
        pass


def test_nothing_trainable_is_a_data_error_naming_the_dataset(tmp_path, tiny_tokenizer):
    cfg = small_config(tmp_path, "drafter.block_size=16", "data.max_length=24")
    with pytest.raises(DataError, match="data.jsonl.*block_size"):
        prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)


# ------------------------------------------------------------------------------------- run dir + CLI


def test_plan_cli_on_the_demo_recipe(tmp_path, capsys):
    run_dir = tmp_path / "demo-run"
    assert main(["plan", "--config", "demo", f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    summary = json.loads((run_dir / "plan" / "summary.json").read_text())
    for key in ("conversations_total", "conversations_kept", "dropped", "tokens", "jobs", "padding_waste",
                "buckets", "eval_conversations"):
        assert key in summary
    demo = load_config("demo")
    held = demo.data.num_eval_conversations
    assert summary["eval_conversations"] == held and summary["conversations_kept"] > 100
    plan = read_epoch_plan(run_dir, 0)
    assert len(plan.jobs) == summary["jobs"] and plan.token_budget == demo.pipeline.token_budget
    assert len((run_dir / "plan" / "eval.jsonl").read_text().splitlines()) == held
    out = capsys.readouterr().out
    assert "padding waste" in out and str(run_dir) in out
    assert sum(b["num_jobs"] for b in summary["buckets"]) == summary["jobs"]  # each job counted in one bucket
    for b in summary["buckets"]:
        assert f"{b['num_sequences']} seqs, longest in {b['num_jobs']} jobs" in out


def test_duplicates_are_dropped_and_counted_before_holding_out(tmp_path, tiny_tokenizer):
    """Exact copies of a conversation: one is kept, the others are counted; a held-out conversation has no
    copy among the training sequences."""
    data = write_dataset(tmp_path / "data.jsonl", n=12)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:12] * 3 + lines[12:]))  # every trainable row three times
    cfg = load_config("demo", [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "run.seed=3",
                               "data.num_eval_conversations=4", "data.max_conversations=null"])
    prepared = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    s = prepared.summary
    assert s.dropped["duplicate"] == 24 and s.eval_conversations == 4 and s.conversations_total == 38
    assert s.conversations_total == s.conversations_kept + s.eval_conversations + sum(s.dropped.values())
    held = {c.messages[0].content for c in prepared.eval_conversations}
    trained = {json.loads(lines[int(i)])["messages"][0]["content"] for i in prepared.train.source_index}
    assert len(trained) == s.conversations_kept and not held & trained


def test_the_cache_is_keyed_on_the_data_files_content_not_their_size_and_mtime(tmp_path, tiny_tokenizer):
    import os

    cfg = small_config(tmp_path)
    data = tmp_path / "data.jsonl"
    first = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    stat = os.stat(data)
    text = data.read_text()
    data.write_text(text.replace("question number 1?", "question number 9?", 1))  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(data).st_size == stat.st_size and os.stat(data).st_mtime_ns == stat.st_mtime_ns
    edited = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    assert not edited.summary.cache_hit and edited.summary.content_sha256 != first.summary.content_sha256


def test_a_moved_dataset_and_tokenizer_find_their_cache(tmp_path, tiny_tokenizer, monkeypatch):
    """The key holds what the files and the tokenizer contain, not where they lie: a copy elsewhere hits."""
    from transformers import AutoTokenizer

    cfg = small_config(tmp_path)
    here, there = tmp_path / "tok-a", tmp_path / "elsewhere" / "tok-b"
    tiny_tokenizer.save_pretrained(here)
    tiny_tokenizer.save_pretrained(there)
    first = prepare_data(cfg, tmp_path / "run", tokenizer=AutoTokenizer.from_pretrained(here))
    assert not first.summary.cache_hit
    moved = tmp_path / "elsewhere" / "renamed-dir"
    moved.mkdir()
    (moved / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text())
    (tmp_path / "data.jsonl").unlink()
    monkeypatch.setattr(prepare_module, "tokenize_all", lambda *a, **k: pytest.fail("re-tokenized a moved dataset"))
    moved_cfg = load_config("demo", [f"data.path={moved / 'data.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
                                     "data.num_eval_conversations=5", "data.max_conversations=null"])
    again = prepare_data(moved_cfg, tmp_path / "run2", tokenizer=AutoTokenizer.from_pretrained(there))
    assert again.summary.cache_hit and again.train.lengths == first.train.lengths
    monkeypatch.undo()
    # the file's name stays in the key: its suffix picks the format the same bytes are read as (here: not a JSON
    # array, an error a cache hit would have hidden)
    renamed = moved / "data.json"
    (moved / "data.jsonl").rename(renamed)
    as_json = load_config("demo", [f"data.path={renamed}", f"data.cache_dir={tmp_path / 'cache'}",
                                   "data.num_eval_conversations=5", "data.max_conversations=null"])
    with pytest.raises(DataError, match="expected a JSON array"):
        prepare_data(as_json, tmp_path / "run3", tokenizer=tiny_tokenizer)


def test_a_folder_source_is_fingerprinted_by_its_data_files_not_a_lock_file(tmp_path):
    from dflash_trainer.data.sources import source_fingerprint

    folder = tmp_path / "regen"
    folder.mkdir()
    write_dataset(folder / "shard_00000.jsonl", n=4)
    config = load_config("demo", [f"data.path={folder}"]).data
    before = source_fingerprint(config)
    (folder / ".lock").touch()  # left by a regenerate run; a packed copy has none
    assert source_fingerprint(config) == before
    write_dataset(folder / "shard_00001.jsonl", n=4)
    assert source_fingerprint(config) != before


def test_sampled_replies_to_a_held_out_prompt_leave_the_training_set(tmp_path, tiny_tokenizer):
    """`regenerate.num_samples` writes several replies to one prompt: holding one out while training on another
    would leak the prompt. One per chosen prompt is held out, its siblings are counted and trained on by no one."""
    rows = [{"messages": [{"role": "user", "content": f"question number {i}?"},
                          {"role": "assistant", "content": reply(i + 100 * k, 12 + (i + k) % 20)}]}
            for i in range(10) for k in range(3)]  # three different replies to each of 10 prompts
    data = tmp_path / "samples.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("demo", [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "run.seed=1",
                               "data.num_eval_conversations=3", "data.max_conversations=null"])
    prepared = prepare_data(cfg, tmp_path / "run", tokenizer=tiny_tokenizer)
    s = prepared.summary
    assert s.eval_conversations == 3 and s.dropped["held_out_prompt_sibling"] == 6
    held = [c.messages[0].content for c in prepared.eval_conversations]
    trained = {rows[int(i)]["messages"][0]["content"] for i in prepared.train.source_index}
    assert len(set(held)) == 3 and not set(held) & trained and len(trained) == 7


def test_hold_out_without_shared_prompts_draws_as_before():
    from dflash_trainer.data.plan import hold_out
    from dflash_trainer.data.types import Conversation, Message

    convs = [Conversation(messages=(Message(role="user", content=f"q{i}"), Message(role="assistant", content="a")),
                          source="s", source_index=i) for i in range(30)]
    split = hold_out(convs, 5, seed=7)
    import random

    expected = sorted(random.Random("eval:7").sample(range(30), 5))
    assert [c.source_index for c in split.eval] == expected and split.siblings_dropped == 0
    assert len(split.train) == 25
