"""`regenerate` and `synthesize` against an OpenAI-compatible server that fails (issue 52, classes 1 and 2).

Class 1: when every request fails, the command names the cause, counted per kind, in one line, with a fix that
fits it (check the server; raise a limit only for a length limit). Class 2: a useless dataset is never reported as
a success: an empty or null reply is a failure, never a row; a server that dies mid-run leaves a partial output
that exits non-zero, says how to finish, and is marked `complete: false` (and `train` warns about it); a reply
from another model than the one asked for is taken, warned about once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fake_openai_server import Behaviour, FakeServer

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.regen import read_manifest, read_rows
from dflash_trainer.regen.settings import warn_regen_mismatch

TINY = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
        "logging.progress=false"]
FAST = ["regenerate.max_retries=1", "regenerate.retry_backoff_s=0.01", "regenerate.request_timeout_s=2"]
"""A failing request is given up quickly."""


def prompts(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(n)))
    return path


def regenerate_cli(server: FakeServer, data: Path, out: Path, *extra: str) -> int:
    return cli.main(["regenerate", "--out", str(out), f"data.path={data}", *TINY, *FAST, "regenerate.backend=openai",
                     f"regenerate.url={server.url}", "regenerate.model=tiny-model", *extra])


def synthesize_cli(server: FakeServer, out: Path, *extra: str) -> int:
    return cli.main(["synthesize", "--out", str(out), *TINY, *FAST, "regenerate.backend=openai",
                     f"regenerate.url={server.url}", "regenerate.model=tiny-model", "synthesize.num_prompts=6",
                     "synthesize.batch_size=6", "synthesize.near_dup_threshold=null", *extra])


def failed_entries(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "failed.jsonl").read_text().splitlines()]


def partial_warnings(out: Path) -> list[str]:
    """What `train` warns about when given `out` as its data (it calls `warn_regen_mismatch` at setup)."""
    return [w for w in warn_regen_mismatch(load_config(None, [*TINY, f"data.path={out}"])) if "partial" in w]


# ---------------------------------------------------------------- class 1: every request fails, the cause named


SERVER_FAULTS = [  # (fake server behaviour, the kind counted, a word of the fix)
    (dict(fault="http_500"), "HTTP 500", "check the server (its log) at regenerate.url"),
    (dict(fault="malformed_json"), "malformed JSON", "check the server (its log) at regenerate.url"),
    (dict(fault="no_choices"), "no choices", "check the server (its log) at regenerate.url"),
    (dict(fault="http_404"), "HTTP 404", "check regenerate.url and regenerate.model"),
    (dict(slow_first=100, slow_s=1.0), "timeout", "raise regenerate.request_timeout_s"),
]
FAULT_IDS = ["http-500", "malformed-json", "no-choices", "http-404", "timeout"]


@pytest.mark.parametrize("behaviour, kind, fix", SERVER_FAULTS, ids=FAULT_IDS)
def test_regenerate_names_the_server_fault_per_kind_when_every_request_fails(tmp_path, capsys, behaviour, kind, fix):
    data, out = prompts(tmp_path, 4), tmp_path / "out"
    timeout = ["regenerate.request_timeout_s=0.2"] if kind == "timeout" else []
    with FakeServer(Behaviour(**behaviour)) as server:
        assert regenerate_cli(server, data, out, *timeout) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1  # one line
    assert f"wrote no row to {out}: of 4 conversations, 4 failed ({kind}: 4; details in {out / 'failed.jsonl'})" in err
    assert fix.lower() in err.lower() and "raise the limit" not in err.lower() and "rerun the same command" in err
    assert {e["kind"] for e in failed_entries(out)} == {kind}
    manifest = read_manifest(out)
    assert manifest["failures"] == {kind: 4} and manifest["complete"] is False and manifest["rows_missing"] == 4


def test_mixed_reasons_are_counted_each_and_a_length_refusal_asks_for_a_longer_context(tmp_path, capsys):
    """Two prompts hit a 500, one is refused (HTTP 400: over the server's context): both counted, both fixes;
    a refusal alone says to raise the server's context (a length limit), never to check the server."""
    data, out = prompts(tmp_path, 3), tmp_path / "out"
    with FakeServer(Behaviour(always_fail=frozenset({"q0", "q1"}), reject=frozenset({"q2"}))) as server:
        assert regenerate_cli(server, data, out) == 2
    err = capsys.readouterr().err
    assert "of 3 conversations, 3 failed (HTTP 500: 2, HTTP 400: 1; details in" in err
    assert "Check the server (its log) at regenerate.url; the server refused the prompt (HTTP 400" in err
    with FakeServer(Behaviour(reject=frozenset({"q0", "q1", "q2"}))) as server:
        assert regenerate_cli(server, data, tmp_path / "refused") == 2
    err = capsys.readouterr().err
    assert "3 failed (HTTP 400: 3;" in err and "raise the server's context length" in err
    assert "check the server" not in err.lower()
    assert read_manifest(tmp_path / "refused")["complete"] is True  # a rerun would be refused again: settled


@pytest.mark.parametrize("behaviour, kind, fix", SERVER_FAULTS[:3] + SERVER_FAULTS[4:],
                         ids=FAULT_IDS[:3] + FAULT_IDS[4:])
def test_synthesize_names_the_server_fault_per_kind_when_every_request_fails(tmp_path, capsys, behaviour, kind, fix):
    out = tmp_path / "out"
    timeout = ["regenerate.request_timeout_s=0.2"] if kind == "timeout" else []
    with FakeServer(Behaviour(**behaviour)) as server:
        assert synthesize_cli(server, out, *timeout) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (f"wrote no conversation to {out}: of 6 openings sampled, dropped none; 6 failed ({kind}: 6; details in "
            f"{out / 'failed.jsonl'})") in err
    assert fix.lower() in err.lower() and "loosen the filters" not in err.lower()
    assert read_manifest(out)["complete"] is False


# ---------------------------------------------------------------- class 2: never a useless dataset as a success


@pytest.mark.parametrize("fault", ["null_content", "empty_content", "whitespace_content"])
def test_regenerate_counts_a_reply_without_content_as_a_failure_never_a_row(tmp_path, capsys, fault):
    data, out = prompts(tmp_path, 4), tmp_path / "out"
    with FakeServer(Behaviour(fault=fault)) as server:
        assert regenerate_cli(server, data, out) == 2
        asked = len(server.behaviour.requests)
    err = capsys.readouterr()
    assert "rows done" not in err.out and "Train on it" not in err.out
    assert "4 failed (empty reply: 4;" in err.err and "check its chat template and reasoning parser" in err.err
    assert list(read_rows(out)) == []
    assert all(e["kind"] == "empty reply" and "no content" in e["reason"] for e in failed_entries(out))
    assert asked == 4  # not retried: the same request gets the same reply


def test_synthesize_counts_an_answer_without_content_as_a_failure_never_a_row(tmp_path, capsys):
    out = tmp_path / "out"
    with FakeServer(Behaviour(fault="null_content", fault_on=frozenset({"chat"}))) as server:
        assert synthesize_cli(server, out) == 2
    captured = capsys.readouterr()
    assert "conversations kept" not in captured.out
    assert "6 failed (empty reply: 6;" in captured.err and "check its chat template" in captured.err
    assert list(read_rows(out)) == []


def test_a_null_completion_text_is_a_failure_not_a_traceback(tmp_path, capsys):
    """Null `text` from the completions endpoint (where synthesize writes its user turns)."""
    out = tmp_path / "out"
    with FakeServer(Behaviour(fault="null_content", fault_on=frozenset({"completions"}))) as server:
        assert synthesize_cli(server, out) == 2
    assert "6 failed (unexpected reply: 6;" in capsys.readouterr().err


def test_regenerate_on_a_server_that_dies_mid_run_exits_non_zero_marks_the_output_partial_and_resumes(tmp_path,
                                                                                                        capsys):
    data, out = prompts(tmp_path, 10), tmp_path / "out"
    with FakeServer(Behaviour(die_after=4)) as server:
        assert regenerate_cli(server, data, out, "regenerate.concurrency=2") == 2
    captured = capsys.readouterr()
    assert "regenerate: 4 rows done (4 new) of 10 conversations, 6 failed (connection error: 6; details in" \
        in captured.out and "Train on it" not in captured.out
    assert (f"{out} is partial: 6 of 10 conversations missing, 6 failed (connection error: 6; details in "
            f"{out / 'failed.jsonl'}). Check the server (its log) at regenerate.url, then rerun the same command to "
            "finish: the 4 rows written are kept") in captured.err
    manifest = read_manifest(out)
    assert (manifest["complete"], manifest["rows_done"], manifest["rows_missing"]) == (False, 4, 6)
    assert manifest["failures"] == {"connection error": 6}
    [warning] = partial_warnings(out)  # `train` on the folder warns: how many are missing, why, how to finish
    assert f"{out} is a partial regenerate output (4 rows done of 10, 6 missing; 6 failed (connection error: 6;" \
        in warning and f"Rerun the same `dflash-train regenerate --out {out}` to finish" in warning
    with FakeServer() as server:  # the server is back: the rerun writes the missing rows only
        assert regenerate_cli(server, data, out) == 0
        assert len(server.behaviour.requests) == 6
    assert "10 rows done (6 new) of 10 conversations; output in" in capsys.readouterr().out
    assert sorted(r["id"] for r in read_rows(out)) == sorted(f"{data}:{i}" for i in range(10))
    assert read_manifest(out)["complete"] is True and partial_warnings(out) == []


def test_synthesize_on_a_server_that_dies_mid_run_exits_non_zero_marks_the_output_partial_and_resumes(tmp_path,
                                                                                                        capsys):
    """Six user turns, then three answers, then nothing: 3 kept, and the next chunk fails whole."""
    out = tmp_path / "out"
    with FakeServer(Behaviour(die_after=9)) as server:
        assert synthesize_cli(server, out) == 2
    captured = capsys.readouterr()
    assert "synthesize: 3 conversations kept (3 new) of 6 wanted" in captured.out
    assert "9 failed (connection error: 9; details in" in captured.out and "Train on it" not in captured.out
    assert f"{out} is partial: 3 of 6 conversations missing" in captured.err
    assert "rerun the same command to finish: the 3 conversations written are kept" in captured.err
    manifest = read_manifest(out)
    assert (manifest["complete"], manifest["rows_done"], manifest["rows_missing"]) == (False, 3, 3)
    [warning] = partial_warnings(out)
    assert "partial synthesize output (3 rows done of 6, 3 missing; 9 failed (connection error: 9;" in warning
    assert f"dflash-train synthesize --out {out}` to finish" in warning
    with FakeServer() as server:
        assert synthesize_cli(server, out) == 0
    assert "6 conversations kept (3 new) of 6 wanted" in capsys.readouterr().out
    assert len(list(read_rows(out))) == 6 and read_manifest(out)["complete"] is True and partial_warnings(out) == []


def test_failed_attempts_do_not_use_up_synthesize_max_attempts(tmp_path, capsys):
    """max_attempts = num_prompts: a server fault on some attempts must not end the run as if the filters had
    dropped them (complete, exit 0); the rerun gets the attempts back and finishes."""
    out = tmp_path / "out"
    with FakeServer(Behaviour(die_after=9)) as server:
        assert synthesize_cli(server, out, "synthesize.max_attempts=6") == 2
    assert read_manifest(out)["complete"] is False and "is partial" in capsys.readouterr().err
    with FakeServer() as server:
        assert synthesize_cli(server, out, "synthesize.max_attempts=6") == 0
    assert len(list(read_rows(out))) == 6


def test_a_reply_from_another_model_is_taken_and_warned_about_once(tmp_path, caplog, capsys):
    data = prompts(tmp_path, 5)
    with FakeServer(Behaviour(reply_model="some-proxy/renamed")) as server:
        with caplog.at_level(logging.WARNING, logger="dflash_trainer.regen.openai"):
            assert regenerate_cli(server, data, tmp_path / "regen") == 0
            assert synthesize_cli(server, tmp_path / "synth") == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "dflash_trainer.regen.openai"]
    assert len(warned) == 2  # once per command (per backend), not per reply
    assert all("'some-proxy/renamed', not 'tiny-model'" in w for w in warned)
    assert len(list(read_rows(tmp_path / "regen"))) == 5 and len(list(read_rows(tmp_path / "synth"))) == 6


@pytest.mark.parametrize("damage", [b"\xc3\x28 not UTF-8", b'{"messages": [', b"[1, 2]"])
def test_a_shard_damaged_on_disk_is_repaired_by_a_rerun_which_asks_for_its_rows_again(tmp_path, caplog, damage):
    """A row damaged after it was written (a flipped byte, a cut write) is named when read, and the rerun of the
    same command drops it and asks for that row only, keeping the others (never a new --out and the work lost)."""
    data, out = prompts(tmp_path, 5), tmp_path / "out"
    with FakeServer() as server:
        assert regenerate_cli(server, data, out) == 0
    shard = out / "shard_00000.jsonl"
    lines = shard.read_bytes().split(b"\n")
    shard.write_bytes(b"\n".join([lines[0], damage, *lines[2:]]))  # the second row damaged
    with pytest.raises(Exception, match=r"shard_00000.jsonl:2: .*damaged: rerun the same"):
        list(read_rows(out))
    with FakeServer() as server, caplog.at_level(logging.WARNING):
        assert regenerate_cli(server, data, out) == 0
        assert len(server.behaviour.requests) == 1  # the damaged row's conversation only
    assert "dropped 1 damaged line(s) (lines 2" in caplog.text
    assert sorted(r["id"] for r in read_rows(out)) == sorted(f"{data}:{i}" for i in range(5))
    assert read_manifest(out)["complete"] is True


@pytest.mark.parametrize("damage", [b'{"format": "dflash-regen', b'\xff\xfe{}', b"[]"])
def test_a_damaged_manifest_is_named_to_train_and_rewritten_by_a_rerun(tmp_path, caplog, damage):
    """A cut, non-UTF-8 or foreign manifest: `train` on the folder warns naming it (never a JSONDecodeError or
    UnicodeDecodeError), the rows still load, and the rerun of the same command keeps the rows and rewrites it."""
    from dflash_trainer.data.sources import load_source
    from dflash_trainer.data.config import DataSourceConfig

    data, out = prompts(tmp_path, 4), tmp_path / "out"
    with FakeServer() as server:
        assert regenerate_cli(server, data, out) == 0
    (out / "manifest.json").write_bytes(damage)
    [warning] = warn_regen_mismatch(load_config(None, [*TINY, f"data.path={out}"]))
    assert f"{out / 'manifest.json'} is damaged" in warning and "rerun the same" in warning
    assert load_source(DataSourceConfig(path=str(out))).report.kept == 4
    with FakeServer() as server, caplog.at_level(logging.WARNING):
        assert regenerate_cli(server, data, out) == 0
        assert server.behaviour.requests == []  # every row was kept
    assert "manifest.json is damaged" in caplog.text
    assert read_manifest(out)["complete"] is True and read_manifest(out)["rows_done"] == 4
