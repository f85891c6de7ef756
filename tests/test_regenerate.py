"""`dflash-train regenerate`: local and HTTP backends, multi-turn rebuild, resume, failures, settings."""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_openai_server import Behaviour, FakeServer

from dflash_trainer.config import load_config
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.regen import check_regen_settings, read_manifest, read_rows, regenerate
from dflash_trainer.regen.openai import OpenAIBackend
from dflash_trainer.regen.settings import RegenSettings

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)
SETTINGS = RegenSettings(
    backend="openai", model="tiny-model", thinking=False, temperature=0.0, max_new_tokens=8, chat_template=None
)


def conv(index: int, *turns: tuple[str, str], source: str = "src") -> Conversation:
    return Conversation(
        messages=tuple(Message(role=r, content=c) for r, c in turns), source=source, source_index=index
    )


def simple(n: int, source: str = "src") -> list[Conversation]:
    return [conv(i, ("user", f"q{i}"), ("assistant", "ORIGINAL"), source=source) for i in range(n)]


def http_backend(url: str, **kw) -> OpenAIBackend:
    args = dict(
        url=url, model="tiny-model", max_new_tokens=8, temperature=0.0, thinking=False, concurrency=4,
        request_timeout_s=5.0, max_retries=2, retry_backoff_s=0.01,
    )
    args.update(kw)
    return OpenAIBackend(**args)


def shard_ids(out: Path) -> list[str]:
    return [row["id"] for row in read_rows(out)]


# ---------------------------------------------------------------- local backend (tiny target)


@pytest.fixture(scope="module")
def tiny_local():
    """The tiny target on CPU; one intra-op thread (tiny matmuls gain nothing from more, and spin under load)."""
    import torch

    from dflash_trainer.target.load import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config(None, ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32"])
    yield cfg, load_target(cfg.target, "cpu", seed=0)
    torch.set_num_threads(threads)


def local_backend(tiny_local, tokenizer, **kw):
    from dflash_trainer.regen.local import LocalBackend

    args = dict(max_new_tokens=8, temperature=0.0, thinking=False, batch_size=3)
    args.update(kw)
    return LocalBackend(model=tiny_local[1], tokenizer=tokenizer, **args)


def test_local_backend_multi_turn_rows(tmp_path, tiny_local, tiny_tokenizer):
    convs = [
        conv(0, ("system", "be brief"), ("user", "hello there"), ("assistant", "ORIGINAL"), ("user", "and then?"),
             ("assistant", "ORIGINAL")),
        conv(1, ("user", "a longer question about the weather today"), ("assistant", "ORIGINAL")),
        conv(2, ("user", "prompt only")),
        conv(3, ("assistant", "starts with the assistant")),
        conv(4, ("user", "x"), ("tool", "{}")),
    ]
    summary = regenerate(convs, backend=local_backend(tiny_local, tiny_tokenizer), out_dir=tmp_path,
                         settings=SETTINGS, progress=False)
    assert (summary.rows_done, summary.rows_failed, summary.complete) == (3, 2, True)
    rows = {row["id"]: row for row in read_rows(tmp_path)}
    assert set(rows) == {"src:0", "src:1", "src:2"}
    roles = [m["role"] for m in rows["src:0"]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    contents = [m["content"] for m in rows["src:0"]["messages"]]
    assert contents[:2] == ["be brief", "hello there"] and contents[3] == "and then?"
    assert "ORIGINAL" not in contents
    assert [m["role"] for m in rows["src:2"]["messages"]] == ["user", "assistant"]
    failed = [json.loads(line) for line in (tmp_path / "failed.jsonl").read_text().splitlines()]
    reasons = {f["id"]: f["reason"] for f in failed}
    assert set(reasons) == {"src:3", "src:4"}
    assert reasons["src:3"].startswith("no_user_turn:") and reasons["src:4"].startswith("unknown_role:")


def test_local_batched_greedy_matches_one_by_one(tmp_path, tiny_local, tiny_tokenizer):
    """Left padding and length-sorted batches must not change greedy replies."""
    convs = [conv(i, ("user", "word " * (1 + 3 * i)), ("assistant", "x"), ("user", f"next {i}")) for i in range(5)]
    out = {}
    for batch_size in (1, 4):
        d = tmp_path / f"b{batch_size}"
        regenerate(convs, backend=local_backend(tiny_local, tiny_tokenizer, batch_size=batch_size), out_dir=d,
                   settings=SETTINGS, progress=False)
        out[batch_size] = {row["id"]: row["messages"] for row in read_rows(d)}
    assert out[1] == out[4]
    assert all(len(m) == 4 for m in out[1].values())


def test_local_thinking_prefix_and_generation_prompt(tiny_local, tiny_tokenizer):
    """enable_thinking reaches the template; a think block opened by the prompt starts the stored reply."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "{%- if enable_thinking is defined and enable_thinking is false -%}",
        "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}",
    )
    c = [conv(0, ("user", "hi"))]
    on = next(iter(local_backend(tiny_local, tok, thinking=True).run(c)))
    off = next(iter(local_backend(tiny_local, tok, thinking=False).run(c)))
    assert on.messages[-1].content.startswith("<think>\n")
    assert not off.messages[-1].content.startswith("<think>")


def test_command_run_local(tmp_path, monkeypatch, capsys):
    from dflash_trainer.commands import regenerate as command

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "old"}]}) + "\n"
        for i in range(6)
    ))
    out = tmp_path / "out"
    cfg = load_config(None, [f"data.path={data}",
        "target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
        "regenerate.max_new_tokens=4", "data.max_conversations=4", "logging.progress=false",
    ])
    with pytest.raises(ConfigError, match="--out"):
        command.run(cfg, argparse.Namespace(out=None))
    assert command.run(cfg, argparse.Namespace(out=str(out))) == 0
    ids = shard_ids(out)
    assert len(ids) == 4 and len(set(ids)) == 4
    manifest = read_manifest(out)
    assert manifest["settings"]["model"] == "random_init=tiny" and manifest["settings"]["thinking"] is False
    assert manifest["source"]["conversations"] == {str(data): 4}
    report = manifest["source"]["report"]  # the source's load report as fields, not a repr string
    assert report["kept"] == 4 and report["source"] == str(data) and report["stopped_early"] is True
    assert "4 rows done (4 new) of 4 conversations;" in capsys.readouterr().out
    # two replies each: a row per reply, counted as such
    two = load_config(None, [f"data.path={data}", "target.random_init=tiny", "target.tokenizer=tiny",
                             "target.dtype=float32", "run.device=cpu", "regenerate.max_new_tokens=4",
                             "data.max_conversations=4", "logging.progress=false", "regenerate.num_samples=2",
                             "regenerate.temperature=0.8"])
    assert command.run(two, argparse.Namespace(out=str(tmp_path / "two"))) == 0
    assert "8 rows done (8 new) of 8 rows (4 conversations x 2 replies);" in capsys.readouterr().out


def test_prompt_only_datasets_are_regenerated_then_trainable(tmp_path, capsys):
    """Prompt-only rows (a JSONL of single user turns; a ShareGPT file whose rows end with a user turn): the
    command answers every user turn; `plan` skips the prompt-only source with the counted reason and takes the
    regenerated one."""
    from dflash_trainer import cli
    from dflash_trainer.data.config import DataConfig
    from dflash_trainer.data.sources import load_conversations

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write a haiku about {w}."}]})
                               + "\n" for w in ("rain", "snow", "wind")))
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"},
                           {"from": "human", "value": "and the weather?"}]},
        {"conversations": [{"from": "human", "value": "just a question"}]},
    ]))
    tiny = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            "regenerate.max_new_tokens=40", "logging.progress=false", "drafter.block_size=4", "drafter.gamma=2", "drafter.num_layers=1",
            "data.max_length=256", "pipeline.token_budget=512", f"data.cache_dir={tmp_path / 'tok'}"]
    assert load_conversations(DataConfig(path=str(prompts)), seed=0).report.dropped == {"no_assistant_turn": 3}
    for source, out in ((prompts, tmp_path / "a"), (sharegpt, tmp_path / "b")):
        assert cli.main(["regenerate", "--out", str(out), f"data.path={source}", *tiny]) == 0
    rows = {r["id"]: [m["role"] for m in r["messages"]] for r in read_rows(tmp_path / "a")}
    assert sorted(rows) == [f"{prompts}:{i}" for i in range(3)] and set(map(tuple, rows.values())) == {("user", "assistant")}
    rows = sorted([m["role"] for m in r["messages"]] for r in read_rows(tmp_path / "b"))
    assert rows == [["user", "assistant"], ["user", "assistant", "user", "assistant"]]  # every user turn answered
    assert cli.main(["plan", f"data.path={prompts}", f"run.dir={tmp_path / 'p1'}", *tiny]) == 2  # nothing to train on
    assert "no_assistant_turn" in capsys.readouterr().err
    assert cli.main(["plan", f"data.path={tmp_path / 'b'}", f"run.dir={tmp_path / 'p2'}", "data.num_eval_conversations=0",
                     *tiny]) == 0
    summary = json.loads((tmp_path / "p2" / "plan" / "summary.json").read_text())
    assert summary["conversations_kept"] + sum(summary["dropped"].values()) == 2


def test_another_source_into_an_existing_output_is_refused(tmp_path, capsys):
    """Regenerating another data source into a finished output would mix the two and rename the manifest's
    source: refused, naming both and the fix; the same source resumes."""
    from dflash_trainer import cli

    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} {i}?"}]}) + "\n"
                                for i in range(2)))
        paths.append(path)
    tiny = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            "regenerate.max_new_tokens=4", "logging.progress=false"]
    out = tmp_path / "out"
    assert cli.main(["regenerate", "--out", str(out), f"data.path={paths[0]}", *tiny]) == 0
    before = sorted(shard_ids(out))
    assert cli.main(["regenerate", "--out", str(out), f"data.path={paths[1]}", *tiny]) == 2
    err = capsys.readouterr().err
    assert f"holds the answers to ['{paths[0]}']" in err and "new --out directory" in err
    assert sorted(shard_ids(out)) == before and read_manifest(out)["source"]["data"] == [str(paths[0])]
    assert cli.main(["regenerate", "--out", str(out), f"data.path={paths[0]}", *tiny]) == 0  # the same: resumes


# ---------------------------------------------------------------- HTTP backend


def test_http_multi_turn_request_and_reasoning(tmp_path):
    behaviour = Behaviour(reasoning=True)
    c = conv(7, ("system", "sys"), ("user", "first"), ("assistant", "ORIGINAL"), ("user", "second"))
    with FakeServer(behaviour) as server:
        backend = http_backend(server.url.removesuffix("/v1") + "/", thinking=True, temperature=0.7)
        backend.check_model()
        regenerate([c, c], backend=backend, out_dir=tmp_path, settings=SETTINGS, progress=False)
    [row] = list(read_rows(tmp_path))  # a repeated id is answered once
    assert row["id"] == "src:7"
    first_reply = "<think>\nthinking about first\n</think>\n\nre:first"
    assert [m["content"] for m in row["messages"]] == ["sys", "first", first_reply, "second",
                                                        "<think>\nthinking about second\n</think>\n\nre:second"]
    first, second = behaviour.requests
    assert first["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"}]
    assert second["messages"][2] == {"role": "assistant", "content": first_reply}  # conditioned on the new reply
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    assert (first["max_tokens"], first["temperature"], first["model"]) == (8, 0.7, "tiny-model")


def test_http_retries_then_fails(tmp_path):
    behaviour = Behaviour(fail_first=2, always_fail=frozenset({"q3"}), reject=frozenset({"q4"}))
    with FakeServer(behaviour) as server:
        summary = regenerate(simple(6), backend=http_backend(server.url, max_retries=2), out_dir=tmp_path,
                             settings=SETTINGS, progress=False)
    # q3's server fault leaves the output incomplete (a rerun may write it); q4's refusal does not
    assert (summary.rows_done, summary.rows_failed, summary.complete) == (4, 2, False)
    assert summary.failures == {"HTTP 500": 1, "HTTP 400": 1} and summary.rows_missing == 1
    assert sorted(shard_ids(tmp_path)) == ["src:0", "src:1", "src:2", "src:5"]
    assert behaviour.attempts["q0"] == 3 and behaviour.attempts["q3"] == 3
    reasons = {f["id"]: f["reason"] for f in map(json.loads, (tmp_path / "failed.jsonl").read_text().splitlines())}
    assert "gave up after 3 attempts" in reasons["src:3"] and "HTTP 500" in reasons["src:3"]
    assert "HTTP 400" in reasons["src:4"] and behaviour.attempts["q4"] == 1  # a 400 is not retried
    assert read_manifest(tmp_path)["rows_failed"] == 2


def test_a_later_turn_the_server_refuses_ends_the_conversation_and_keeps_the_answered_turns(tmp_path):
    """HTTP 400 at a later turn (a server's context limit): the row is written with the turns before it and
    counted as cut; at the first turn the row fails, as before."""
    from dflash_trainer.regen.openai import REFUSED_LATER_TURN

    behaviour = Behaviour(reject=frozenset({"too long", "first too long"}))
    convs = [conv(0, ("user", "hi"), ("assistant", "a"), ("user", "too long"), ("assistant", "b")),
             conv(1, ("user", "first too long"), ("assistant", "a"))]
    with FakeServer(behaviour) as server:
        summary = regenerate(convs, backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS,
                             progress=False)
    assert (summary.rows_done, summary.rows_failed, summary.rows_cut) == (1, 1, {REFUSED_LATER_TURN: 1})
    [row] = list(read_rows(tmp_path))
    assert row["id"] == "src:0" and row["cut"] == REFUSED_LATER_TURN
    assert [m["content"] for m in row["messages"]] == ["hi", "re:hi"]


def test_http_timeout_is_retried(tmp_path):
    behaviour = Behaviour(slow_first=1, slow_s=3.0)
    with FakeServer(behaviour) as server:
        t0 = time.monotonic()
        summary = regenerate(simple(3), backend=http_backend(server.url, request_timeout_s=0.3), out_dir=tmp_path,
                             settings=SETTINGS, progress=False)
    assert summary.rows_done == 3 and summary.rows_failed == 0
    assert all(behaviour.attempts[f"q{i}"] == 2 for i in range(3))
    assert time.monotonic() - t0 < 2.5  # the slow first attempts were abandoned, not waited for


def test_http_model_mismatch_and_unreachable():
    with FakeServer(Behaviour(models=("Qwen/Qwen3-8B",))) as server:
        with pytest.raises(ConfigError, match=r"serves \['Qwen/Qwen3-8B'\], not 'tiny-model'.*regenerate.model"):
            http_backend(server.url).check_model()
        url = server.url
    with pytest.raises(ConfigError, match="cannot list models.*regenerate.url"):
        http_backend(url, request_timeout_s=1.0).check_model()


# ---------------------------------------------------------------- resume and safety


class CrashAfter:
    """Raises KeyboardInterrupt after `n` outcomes, like a Ctrl-C mid-run."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n = inner, n

    def run(self, conversations):
        for i, outcome in enumerate(self.inner.run(conversations)):
            if i == self.n:
                raise KeyboardInterrupt
            yield outcome


def test_crash_resume_truncated_line_and_failed_retry(tmp_path):
    convs = simple(10)
    with FakeServer(Behaviour(always_fail=frozenset({"q9"}))) as server:
        with pytest.raises(KeyboardInterrupt):
            regenerate(convs, backend=CrashAfter(http_backend(server.url), 4), out_dir=tmp_path, settings=SETTINGS,
                       shard_rows=3, progress=False)
        assert len(shard_ids(tmp_path)) + read_manifest(tmp_path)["rows_failed"] == 4
        last = sorted(tmp_path.glob("shard_*.jsonl"))[-1]
        with open(last, "a") as f:
            f.write('{"messages": [{"role": "user", "con')  # a row cut mid-write
        assert len(list(read_rows(tmp_path))) == len(shard_ids(tmp_path))  # readers skip the partial line
        summary = regenerate(convs, backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS,
                             shard_rows=3, progress=False)
    ids = shard_ids(tmp_path)
    assert sorted(ids) == sorted(f"src:{i}" for i in range(9)) and len(ids) == len(set(ids))
    assert (summary.rows_done, summary.rows_failed, summary.complete) == (9, 1, False)  # q9: HTTP 500, retryable
    for path in tmp_path.glob("shard_*.jsonl"):
        assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) <= 3
    # the failed row is tried again on the next run and leaves the failure log when it succeeds
    with FakeServer() as server:
        summary = regenerate(convs, backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS,
                             progress=False)
    assert (summary.rows_done, summary.rows_failed, summary.rows_new, summary.complete) == (10, 0, 1, True)
    assert (tmp_path / "failed.jsonl").read_text() == ""
    assert sorted(shard_ids(tmp_path)) == sorted(f"src:{i}" for i in range(10))


def test_rows_with_unicode_line_separators_read_back_and_resume(tmp_path):
    """U+2028, U+0085 and friends stay unescaped in the JSON rows (ensure_ascii=False): they must not split a row."""
    odd = "a\u2028b\x85c\x1cd\u2029e"
    convs = [conv(i, ("user", f"q{i} {odd}"), ("assistant", "ORIGINAL")) for i in range(5)]
    with FakeServer() as server:
        regenerate(convs[:3], backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS, progress=False)
        rows = list(read_rows(tmp_path))
        assert sorted(r["messages"][0]["content"] for r in rows) == [f"q{i} {odd}" for i in range(3)]
        summary = regenerate(convs, backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS,
                             progress=False)  # resume: the rows written are scanned again
    assert (summary.rows_done, summary.rows_new, summary.complete) == (5, 2, True)
    assert sorted(shard_ids(tmp_path)) == sorted(f"src:{i}" for i in range(5))


def test_kill_subprocess_and_resume(tmp_path):
    """SIGKILL mid-run (no cleanup at all), then resume: every row exactly once."""
    n = 40
    script = f"""
import sys
sys.path[:0] = [{SRC!r}, {TESTS!r}]
from test_regenerate import SETTINGS, http_backend, simple
from dflash_trainer.regen import regenerate
regenerate(simple({n}), backend=http_backend(sys.argv[1], concurrency=2), out_dir=sys.argv[2],
           settings=SETTINGS, shard_rows=7, progress=False)
"""
    with FakeServer(Behaviour(delay_s=0.05)) as server:
        proc = subprocess.Popen([sys.executable, "-c", script, server.url, str(tmp_path)], env=dict(os.environ))
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                written = sum(p.read_text().count("\n") for p in tmp_path.glob("shard_*.jsonl"))
                if written >= 8:
                    break
                time.sleep(0.02)
            assert proc.poll() is None, "the child finished before it could be killed"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
        done_before = len(shard_ids(tmp_path))
        assert 8 <= done_before < n
        server.behaviour.delay_s = 0.0
        summary = regenerate(simple(n), backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS,
                             shard_rows=7, progress=False)
    ids = shard_ids(tmp_path)
    assert len(ids) == n and sorted(ids) == sorted(f"src:{i}" for i in range(n))
    assert summary.rows_new == n - done_before and read_manifest(tmp_path)["complete"] is True


def test_refuses_other_settings_and_foreign_dirs(tmp_path):
    with FakeServer() as server:
        regenerate(simple(2), backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS, progress=False)
        other = RegenSettings(**{**SETTINGS.to_dict(), "thinking": True})
        with pytest.raises(DataError, match=r"thinking: the directory has False, this run asks for True.*new --out"):
            regenerate(simple(2), backend=http_backend(server.url), out_dir=tmp_path, settings=other, progress=False)
    from dflash_trainer.regen.shards import RegenStore

    store = RegenStore.open(tmp_path, settings=SETTINGS, shard_rows=4, source={}, expected_ids=set())
    with pytest.raises(DataError, match="another `dflash-train regenerate` is writing"):
        RegenStore.open(tmp_path, settings=SETTINGS, shard_rows=4, source={}, expected_ids=set())
    store.close()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="no manifest.json"):
        regenerate(simple(1), backend=None, out_dir=foreign, settings=SETTINGS, progress=False)


def test_check_regen_settings(tmp_path):
    assert check_regen_settings(tmp_path, thinking=True, temperature=0.0) == []  # not a regenerated dir
    with FakeServer() as server:
        regenerate(simple(2), backend=http_backend(server.url), out_dir=tmp_path, settings=SETTINGS, progress=False)
    assert check_regen_settings(tmp_path, thinking=False, temperature=0.0) == []
    warnings = check_regen_settings(tmp_path, thinking=True, temperature=0.6)
    assert len(warnings) == 2
    assert "thinking=off" in warnings[0] and "thinking=on" in warnings[0]
    assert "temperature=0.0" in warnings[1] and "0.6" in warnings[1]


def test_sampled_source_beside_a_greedy_one_is_not_warned_about(tmp_path, caplog):
    """A mix of greedy replies and replies sampled at 0.8 is deliberate (no advice to regenerate greedy); the
    sampled source alone is still warned about, and so is a thinking mismatch inside a mix."""
    import dataclasses
    import logging

    from dflash_trainer.regen.settings import regen_temperature, warn_regen_mismatch

    greedy, sampled = tmp_path / "greedy", tmp_path / "sampled"
    with FakeServer() as server:
        regenerate(simple(2), backend=http_backend(server.url), out_dir=greedy, settings=SETTINGS, progress=False)
        regenerate(simple(2), backend=http_backend(server.url), out_dir=sampled, progress=False,
                   settings=dataclasses.replace(SETTINGS, temperature=0.8))
    assert (regen_temperature(greedy), regen_temperature(sampled), regen_temperature(tmp_path)) == (0.0, 0.8, None)
    mix = ["target.random_init=tiny", f"data.sources=[{{path: {greedy}}}, {{path: {sampled}, weight: 2}}]"]
    with caplog.at_level(logging.INFO, logger="dflash_trainer.regen.settings"):
        assert warn_regen_mismatch(load_config(None, mix)) == []
    assert "extra replies" in caplog.text and str(sampled) in caplog.text
    alone = warn_regen_mismatch(load_config(None, ["target.random_init=tiny", f"data.path={sampled}"]))
    assert len(alone) == 1 and "temperature=0.8" in alone[0]
    thinking = warn_regen_mismatch(load_config(None, mix + ["data.thinking=true"]))
    assert len(thinking) == 2 and all("thinking=off" in w for w in thinking)


# ---------------------------------------------------------------- several replies per prompt


def test_num_samples_rows_differ_and_resume(tmp_path, tiny_local, tiny_tokenizer):
    """num_samples=3: three rows per conversation (`id`, `id#1`, `id#2`), sampled apart; a rerun adds none."""
    import dataclasses

    settings = dataclasses.replace(SETTINGS, backend="local", temperature=1.0, num_samples=3, seed=5)
    convs = [conv(i, ("user", f"tell me about thing {i}"), ("assistant", "ORIGINAL")) for i in range(4)]
    backend = local_backend(tiny_local, tiny_tokenizer, temperature=1.0, max_new_tokens=12, seed=5)
    summary = regenerate(convs, backend=backend, out_dir=tmp_path, settings=settings, progress=False)
    assert (summary.rows_total, summary.rows_done, summary.complete) == (12, 12, True)
    rows = {row["id"]: row["messages"] for row in read_rows(tmp_path)}
    assert set(rows) == {f"src:{i}{s}" for i in range(4) for s in ("", "#1", "#2")}
    for i in range(4):
        samples = [rows[f"src:{i}{s}"] for s in ("", "#1", "#2")]
        assert all(m[0]["content"] == f"tell me about thing {i}" for m in samples)  # the same prompt
        assert len({m[1]["content"] for m in samples}) > 1  # sampled replies (random tiny target: they differ)
    assert read_manifest(tmp_path)["settings"]["num_samples"] == 3
    again = regenerate(convs, backend=backend, out_dir=tmp_path, settings=settings, progress=False)
    assert again.rows_new == 0 and again.rows_done == 12
    with pytest.raises(DataError, match="num_samples: the directory has 3, this run asks for 2"):
        regenerate(convs, backend=backend, out_dir=tmp_path, settings=dataclasses.replace(settings, num_samples=2),
                   progress=False)


def test_http_samples_carry_their_own_seed_and_top_p(tmp_path):
    import dataclasses

    settings = dataclasses.replace(SETTINGS, temperature=0.8, top_p=0.9, num_samples=2)
    behaviour = Behaviour()
    with FakeServer(behaviour) as server:
        regenerate(simple(2), backend=http_backend(server.url, temperature=0.8, top_p=0.9, seed=3), out_dir=tmp_path,
                   settings=settings, progress=False)
    assert sorted(shard_ids(tmp_path)) == ["src:0", "src:0#1", "src:1", "src:1#1"]
    assert len(behaviour.requests) == 4 and {r["top_p"] for r in behaviour.requests} == {0.9}
    assert len({r["seed"] for r in behaviour.requests}) == 4  # the two samples of a prompt are not the same draw
    greedy = Behaviour()
    with FakeServer(greedy) as server:
        regenerate(simple(1), backend=http_backend(server.url), out_dir=tmp_path / "greedy", settings=SETTINGS,
                   progress=False)
    assert "seed" not in greedy.requests[0] and "top_p" not in greedy.requests[0]


def test_sampling_settings_are_validated_and_old_manifests_resume(tmp_path):
    with pytest.raises(ConfigError, match="regenerate.temperature=0 is greedy"):
        load_config(None, ["regenerate.num_samples=2"])
    with pytest.raises(ConfigError, match="regenerate.top_p must be in"):
        load_config(None, ["regenerate.temperature=0.7", "regenerate.top_p=0"])
    with pytest.raises(ConfigError, match="regenerate.temperature must be a finite number"):
        load_config(None, ["regenerate.temperature=nan"])
    cfg = load_config(None, ["regenerate.temperature=0.7", "regenerate.num_samples=4", "run.seed=9",
                             "target.random_init=tiny"])
    from dflash_trainer.regen.settings import settings_differences, settings_from_config

    settings = settings_from_config(cfg)
    assert (settings.num_samples, settings.seed, settings.top_p) == (4, 9, 1.0)
    # a manifest written before these settings existed resumes when they are at their defaults
    old = {k: v for k, v in SETTINGS.to_dict().items() if k not in ("top_p", "num_samples", "seed")}
    assert settings_differences(old, SETTINGS) == []


def test_nucleus_keeps_the_smallest_top_set():
    import torch

    from dflash_trainer.eval.batched import nucleus

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.9, 0.03, 0.02]])
    kept = nucleus(probs, 0.8)
    assert torch.allclose(kept[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 + 0.3 reach 0.8
    assert torch.allclose(kept[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # the top token alone reaches it
    assert torch.equal(nucleus(probs, 1.0), probs)


def test_prompts_over_max_prompt_tokens_are_skipped_and_counted_and_no_row_is_an_error(tmp_path, capsys):
    """A prompt over `regenerate.max_prompt_tokens` is skipped (not failed), counted by its limit in the output,
    the manifest and failed.jsonl; when no row is written the command exits non-zero, not "Train on it"."""
    from dflash_trainer import cli

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                            for text in ("hi", "hello", "word " * 60)))
    tiny = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            "regenerate.max_new_tokens=4", "logging.progress=false", f"data.path={data}"]
    assert cli.main(["regenerate", "--out", str(tmp_path / "a"), *tiny, "regenerate.max_prompt_tokens=40"]) == 0
    out = capsys.readouterr().out
    limit = "prompt over regenerate.max_prompt_tokens=40"
    assert f"2 rows done (2 new) of 3 conversations, 1 skipped ({limit}) (reasons in" in out
    assert "failed" not in out.split("reasons")[0]
    manifest = read_manifest(tmp_path / "a")
    assert manifest["rows_failed"] == 0 and manifest["rows_skipped"] == {limit: 1} and manifest["complete"]
    (entry,) = map(json.loads, (tmp_path / "a" / "failed.jsonl").read_text().splitlines())
    assert entry["skipped"] == limit and entry["reason"].startswith(f"{limit}: ")

    assert cli.main(["regenerate", "--out", str(tmp_path / "b"), *tiny, "regenerate.max_prompt_tokens=1"]) == 2
    captured = capsys.readouterr()
    assert "Train on it" not in captured.out
    one = limit.replace("40", "1")
    assert f"wrote no row to {tmp_path / 'b'}: of 3 conversations, 3 skipped ({one})" in captured.err
    assert "Raise the limit, then rerun the same command" in captured.err


def test_a_later_turn_over_max_prompt_tokens_ends_the_conversation_and_keeps_the_answered_turns(tmp_path, capsys):
    """Multi-turn: a first turn over the limit skips the row; a later one ends it there (the turns answered
    before it are written, the row counted as cut, also after a resume's rescan of the shards)."""
    from dflash_trainer import cli
    from dflash_trainer.regen import read_rows

    def conv(*users):
        turns = []
        for text in users:
            turns += [{"role": "user", "content": text}, {"role": "assistant", "content": "old"}]
        return json.dumps({"messages": turns}) + "\n"

    data = tmp_path / "chats.jsonl"
    data.write_text(conv("hi", "word " * 60) + conv("hello", "and you?") + conv("word " * 60, "hi"))
    tiny = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
            "regenerate.max_new_tokens=4", "regenerate.max_turns=2", "logging.progress=false", f"data.path={data}",
            "regenerate.max_prompt_tokens=60"]  # the short 2-turn prompts are ~40 tokens, "word " * 60 is ~130
    out = tmp_path / "out"
    assert cli.main(["regenerate", "--out", str(out), *tiny]) == 0
    limit = "prompt over regenerate.max_prompt_tokens=60"
    printed = capsys.readouterr().out
    assert (f"2 rows done (2 new; 1 of them cut short before a later turn ({limit})) of 3 conversations, 1 skipped "
            f"({limit}) (reasons in") in printed
    rows = {r["id"]: r for r in read_rows(out)}
    cut, full = rows[f"{data}:0"], rows[f"{data}:1"]
    assert [m["role"] for m in cut["messages"]] == ["user", "assistant"] and cut["cut"] == limit
    assert cut["messages"][0]["content"] == "hi" and cut["messages"][1]["content"] != "old"
    assert [m["role"] for m in full["messages"]] == ["user", "assistant"] * 2 and "cut" not in full
    manifest = read_manifest(out)
    assert manifest["rows_cut"] == {limit: 1} and manifest["rows_skipped"] == {limit: 1} and manifest["complete"]
    assert cli.main(["regenerate", "--out", str(out), *tiny]) == 0  # a rerun rescans the shards
    assert read_manifest(out)["rows_cut"] == {limit: 1}


def test_training_on_replies_the_target_did_not_write_gets_a_hint(tmp_path):
    """A source that is not a regenerate output (the user's own replies), or one another model regenerated, gets one
    line saying a drafter learns its target's own replies and how to regenerate; the target's own gets none."""
    import dataclasses
    import json

    from dflash_trainer.regen.settings import hint_foreign_replies

    own, other = tmp_path / "own", tmp_path / "other"
    with FakeServer() as server:
        for out, model in ((own, "random_init=tiny"), (other, "Qwen/Qwen3-8B")):
            regenerate(simple(2), backend=http_backend(server.url), out_dir=out, progress=False,
                       settings=dataclasses.replace(SETTINGS, backend="local", model=model))
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    tiny = ["target.random_init=tiny"]
    assert hint_foreign_replies(load_config(None, [*tiny, f"data.path={own}"])) is None
    hint = hint_foreign_replies(load_config(None, [*tiny, f"data.path={mine}"]))
    assert f"{mine} holds replies the target did not write" in hint and "dflash-train regenerate" in hint
    hint = hint_foreign_replies(load_config(None, [*tiny, f"data.sources=[{{path: {own}}}, {{path: {other}}}]"]))
    assert f"{other} (by Qwen/Qwen3-8B) was regenerated by another model than this target (random_init=tiny)" in hint
    assert str(own) + " " not in hint


def test_batches_are_cut_to_the_memory_free_and_say_so(tiny_local, tiny_tokenizer, monkeypatch, caplog):
    """A batch's KV cache and prefill are known before they are allocated: where `regenerate.batch_size` rows of the
    longest prompts would not fit half of the free memory, the batch is cut (logged), and greedy replies stay the
    same; a prompt that fits in no batch is refused with what to lower."""
    import logging

    from dflash_trainer.errors import ConfigError
    from dflash_trainer.regen import batch_memory
    from dflash_trainer.regen.batch_memory import DecodeBudget, cut_batches, decode_budget

    budget = decode_budget(tiny_local[1])
    cfg = tiny_local[1].config
    assert budget.kv_bytes_per_token == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    assert budget.score_bytes_per_pair == cfg.num_attention_heads * 4  # the CPU's attention materialises its scores
    lengths = [10, 10, 10, 40, 40, 40]
    per_row = DecodeBudget(kv_bytes_per_token=1, prefill_bytes_per_token=0, score_bytes_per_pair=0,
                           budget_bytes=100, free_bytes=200)
    assert cut_batches(lengths, list(range(6)), batch_size=4, new_tokens=10, budget=per_row) == [[0, 1, 2], [3, 4], [5]]
    unknown = DecodeBudget(kv_bytes_per_token=1, prefill_bytes_per_token=0, score_bytes_per_pair=0,
                           budget_bytes=None, free_bytes=None)
    assert cut_batches(lengths, list(range(6)), batch_size=4, new_tokens=10, budget=unknown) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ConfigError, match="one 40-token prompt with 70 new tokens needs about .* lower regenerate"):
        cut_batches(lengths, list(range(6)), batch_size=4, new_tokens=70, budget=per_row)

    prompts = [[5 + i] * (3 + 4 * i) for i in range(6)]
    whole = local_backend(tiny_local, tiny_tokenizer, batch_size=6).continue_ids(prompts)
    row = decode_budget(tiny_local[1]).row_bytes(len(prompts[-1]), 8)
    monkeypatch.setattr(batch_memory, "free_bytes", lambda device: int(row * 2 / batch_memory.USABLE_FRACTION) + 1)
    with caplog.at_level(logging.INFO, logger="dflash_trainer.regen.batch_memory"):
        cut = local_backend(tiny_local, tiny_tokenizer, batch_size=6).continue_ids(prompts)
    assert cut == whole
    assert "batches cut to as few as 2 rows (regenerate.batch_size=6)" in caplog.text


def test_the_decode_budget_reads_a_per_layer_head_size():
    """A loaded Gemma 4 refuses to read its per-layer `head_dim` as one attribute: the budget reads the values the
    config stores, the larger of its sliding and full-attention head sizes."""
    from dflash_trainer.regen.batch_memory import decode_budget
    from dflash_trainer.target.config import TargetConfig
    from dflash_trainer.target.load import load_target

    target = load_target(TargetConfig(random_init="tiny-gemma4", dtype="float32", compile=False), "cpu", seed=0)
    values = target.config.to_dict()
    head_dim = max(values["head_dim"], values.get("global_head_dim") or 0)
    assert decode_budget(target).kv_bytes_per_token == values["num_hidden_layers"] * 2 * values["num_key_value_heads"] \
        * head_dim * 4  # fp32
