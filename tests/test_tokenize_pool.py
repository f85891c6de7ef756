"""Tokenizing in worker processes gives exactly what one process gives; failures are raised, never hung."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import random
import time

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.data import tokenize_pool, tokenized
from dflash_trainer.data.masks import end_of_turn_marker
from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_in_workers, tokenize_one
from dflash_trainer.data.tokenized import tokenize_all
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.errors import ConfigError, DataError


def conversations(n: int) -> list[Conversation]:
    """Random multi-turn chats; every 7th has a one-word reply (dropped: too few supervised tokens)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "token", "draft", "block", "model", "train", "speed"]
    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append(Message(role="user", content=" ".join(rng.choices(words, k=rng.randint(3, 20)))))
            reply = "ok" if i % 7 == 0 else " ".join(rng.choices(words, k=rng.randint(10, 60)))
            turns.append(Message(role="assistant", content=reply))
        out.append(Conversation(messages=tuple(turns), source="synthetic", source_index=i))
    return out


def test_workers_give_the_same_dataset_and_drop_counts_as_one_process(tiny_tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(tokenize_pool, "CHUNK_SIZE", 16)  # several chunks per worker: order must hold
    chats = conversations(150)
    kwargs = dict(thinking=False, max_length=96, min_supervised=8)
    one = tokenize_all(chats, tiny_tokenizer, **kwargs)
    with caplog.at_level(logging.INFO, logger="dflash_trainer.data"):
        many = tokenize_all(chats, tiny_tokenizer, num_workers=2, parallel_min_s=0.0, probe=40, **kwargs)  # 110
    assert "worker processes tokenized 110 conversations in" in caplog.text  # the pool's own rate, for tuning
    assert caplog.text.count("tokenizer workers: first of 7 chunks after") == 1  # their start-up, once
    assert one.dropped == many.dropped and one.dropped.get("too_few_supervised_tokens", 0) > 0
    assert len(one.dataset) == len(many.dataset) > 100
    for name in ("input_ids", "loss_mask", "offsets", "source_index", "source_id"):
        assert torch.equal(getattr(one.dataset, name), getattr(many.dataset, name)), name
    assert one.dataset.input_ids.numel() > 150 * 20  # real content, truncation at 96 included


def test_workers_read_the_tokenizer_from_a_file_so_they_start_together(tiny_tokenizer, monkeypatch):
    """A spawned worker's arguments pass through a pipe that the parent writes into until the worker, its imports
    done, reads them: a tokenizer's pickle there (over the pipe's buffer for real vocabularies) made the workers
    start one after another. The arguments hold a path; the workers still tokenize as this process does."""
    sizes = []
    spawn = multiprocessing.get_context("spawn")

    class Recording:
        def Pool(self, *args, **kwargs):
            sizes.append(len(pickle.dumps(kwargs["initargs"])))
            return spawn.Pool(*args, **kwargs)

    monkeypatch.setattr(tokenize_pool.multiprocessing, "get_context", lambda method: Recording())
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tiny_tokenizer, thinking=False),
                                max_length=96, min_supervised=8)
    chats = conversations(40)
    out = tokenize_in_workers(chats, tiny_tokenizer, settings, num_workers=2)
    assert len(sizes) == 1 and sizes[0] < min(2048, len(pickle.dumps(tiny_tokenizer)))
    expected = [tokenize_one(c, tiny_tokenizer, settings) for c in chats]
    assert [r if isinstance(r, str) else r.input_ids.tolist() for r in out] == \
        [r if isinstance(r, str) else r.input_ids.tolist() for r in expected]


def test_a_worker_exception_is_raised_in_the_caller(tiny_tokenizer):
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tiny_tokenizer, thinking=False),
                                max_length=64, min_supervised=1)
    bad = conversations(3) + [None]  # not a Conversation: the worker raises AttributeError
    with pytest.raises(AttributeError):
        tokenize_in_workers(bad, tiny_tokenizer, settings, num_workers=2)


def test_no_result_in_time_becomes_a_data_error_naming_the_setting(tiny_tokenizer):
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tiny_tokenizer, thinking=False),
                                max_length=64, min_supervised=1)
    # A spawned worker needs seconds to import torch, so no chunk can be done within 10 ms.
    with pytest.raises(DataError, match=r"no result from a tokenizer worker in 0.01 s.*data.num_workers=1"):
        tokenize_in_workers(conversations(40), tiny_tokenizer, settings, num_workers=1, chunk_timeout_s=0.01)


def _refuse_to_rebuild():
    raise RuntimeError("this tokenizer cannot be rebuilt here")


class UnrebuildableTokenizer:
    """Pickles fine, fails to unpickle: a remote-code tokenizer whose module a worker cannot import."""

    def __reduce__(self):
        return (_refuse_to_rebuild, ())


def test_a_tokenizer_the_workers_cannot_rebuild_fails_at_once():
    settings = TokenizeSettings(thinking=False, end_of_turn="<|im_end|>", max_length=64, min_supervised=1)
    start = time.monotonic()
    with pytest.raises(DataError, match="could not rebuild the tokenizer.*cannot be rebuilt here"):
        tokenize_in_workers(conversations(40), UnrebuildableTokenizer(), settings, num_workers=2,
                            chunk_timeout_s=100)
    assert time.monotonic() - start < 60  # the first chunk reports it, long before the timeout


def test_a_fast_template_is_tokenized_in_this_process(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(tokenized, "tokenize_in_workers", lambda *a, **k: pytest.fail("worker processes started"))
    out = tokenize_all(conversations(600), tiny_tokenizer, num_workers=4, thinking=False, max_length=96,
                       min_supervised=8)
    assert len(out.dataset) > 500


def test_workers_take_the_rest_when_this_process_would_be_slow(tiny_tokenizer, monkeypatch):
    calls = []

    def workers(rest, tokenizer, settings, *, num_workers, slower_than, check_after_s):
        calls.append((len(rest), num_workers))
        assert slower_than > 0  # the pool must beat this process's own rate
        return [tokenize_one(c, tokenizer, settings) for c in rest]

    monkeypatch.setattr(tokenized, "PROBE_CONVERSATIONS", 10)
    monkeypatch.setattr(tokenized, "tokenize_in_workers", workers)
    chats = conversations(50)
    kwargs = dict(thinking=False, max_length=96, min_supervised=8)
    spread = tokenize_all(chats, tiny_tokenizer, num_workers=3, parallel_min_s=1e-9, **kwargs)  # any time is over
    assert calls == [(40, 3)]
    assert torch.equal(spread.dataset.input_ids, tokenize_all(chats, tiny_tokenizer, **kwargs).dataset.input_ids)


def _arrive_late(seconds: float, conversation: Conversation) -> Conversation:
    time.sleep(seconds)
    return conversation


class LateConversation(Conversation):
    """A conversation that reaches a worker `delay_s` late (it sleeps as it is unpickled there): a slow worker."""

    __slots__ = ("delay_s",)

    def __reduce__(self):
        plain = Conversation(messages=self.messages, source=self.source, source_index=self.source_index)
        return (_arrive_late, (self.delay_s, plain))


def late(chats: list[Conversation], delay_s: float) -> list[Conversation]:
    out = []
    for c in chats:
        slow = LateConversation(messages=c.messages, source=c.source, source_index=c.source_index)
        object.__setattr__(slow, "delay_s", delay_s)
        out.append(slow)
    return out


def test_a_pool_slower_than_this_process_hands_the_rest_back(tiny_tokenizer, monkeypatch, caplog):
    """Workers that tokenize fewer conversations a second than this process, once started, are stopped at the first
    check after their first chunk, and the rest is tokenized here, with the same result."""
    monkeypatch.setattr(tokenize_pool, "CHUNK_SIZE", 16)
    monkeypatch.setattr(tokenized, "POOL_CHECK_S", 0.0)
    chats = conversations(150)
    kwargs = dict(thinking=False, max_length=96, min_supervised=8)
    with caplog.at_level("WARNING", logger="dflash_trainer.data.tokenize_pool"):
        spread = tokenize_all(late(chats, 0.05), tiny_tokenizer, num_workers=2, parallel_min_s=1e-9, probe=20,
                              **kwargs)  # 2 workers x 20 conversations/s at most, against thousands here
    assert "fewer than one process" in caplog.text and "the rest is tokenized in the main process" in caplog.text
    one = tokenize_all(chats, tiny_tokenizer, **kwargs)
    assert spread.dropped == one.dropped and torch.equal(spread.dataset.input_ids, one.dataset.input_ids)


def test_a_slow_start_alone_does_not_stop_the_pool(tiny_tokenizer, monkeypatch, caplog):
    """The workers' start-up (here a first chunk that arrives seconds late) is spent once it is over: a pool as
    fast as this process afterwards keeps going (checked from the first chunk on)."""
    monkeypatch.setattr(tokenize_pool, "CHUNK_SIZE", 16)
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tiny_tokenizer, thinking=False),
                                max_length=96, min_supervised=8)
    chats = conversations(150)
    with caplog.at_level("WARNING", logger="dflash_trainer.data.tokenize_pool"):
        done = tokenize_in_workers(late(chats[:2], 1.5) + chats[2:], tiny_tokenizer, settings, num_workers=2,
                                   slower_than=20.0, check_after_s=0.0)
    assert len(done) == 150 and "fewer than one process" not in caplog.text
    assert [type(r) for r in done] == [type(tokenize_one(c, tiny_tokenizer, settings)) for c in chats]


def test_a_stalled_pool_hands_the_rest_back_when_this_process_can_do_it(tiny_tokenizer, monkeypatch, caplog):
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tiny_tokenizer, thinking=False),
                                max_length=96, min_supervised=8)
    with caplog.at_level("WARNING", logger="dflash_trainer.data.tokenize_pool"):  # no chunk within 10 ms
        done = tokenize_in_workers(conversations(40), tiny_tokenizer, settings, num_workers=1, chunk_timeout_s=0.01,
                                   slower_than=100.0)
    assert done == [] and "no result from a tokenizer worker in 0.01 s" in caplog.text
    # the whole result is still right: the caller tokenizes the rest
    monkeypatch.setattr(tokenized, "tokenize_in_workers", lambda rest, *a, **k: tokenize_in_workers(
        rest, *a, **{**k, "chunk_timeout_s": 0.01}))
    kwargs = dict(thinking=False, max_length=96, min_supervised=8)
    chats = conversations(60)
    spread = tokenize_all(chats, tiny_tokenizer, num_workers=2, parallel_min_s=1e-9, probe=10, **kwargs)
    monkeypatch.undo()
    assert torch.equal(spread.dataset.input_ids, tokenize_all(chats, tiny_tokenizer, **kwargs).dataset.input_ids)


def test_num_workers_is_validated_and_not_part_of_the_cache_key():
    from dflash_trainer.data.tokenized import key_parts

    with pytest.raises(ConfigError, match="data.num_workers"):
        load_config("demo", ["data.num_workers=0"])
    a, b = load_config("demo", ["data.num_workers=1"]), load_config("demo", ["data.num_workers=8"])
    from dflash_trainer.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer("qwen3")
    assert key_parts(a.data, seed=0, block_size=8, tokenizer=tok) == key_parts(b.data, seed=0, block_size=8,
                                                                               tokenizer=tok)
