"""Reading conversations: every format, malformed rows, a cut-off ShareGPT file, the bundled file, the mix."""

from __future__ import annotations

import codecs
import json
import logging

import pytest

from dflash_trainer.data.config import DataConfig, DataSourceConfig
from dflash_trainer.data.sources import load_conversations, load_source, mix_counts
from dflash_trainer.errors import DataError


def msgs(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]


def sharegpt_row(i: int, user: str = "human", bot: str = "gpt") -> dict:
    return {"id": f"r{i}", "conversations": [{"from": user, "value": f"q{i}"}, {"from": bot, "value": f"a{i}"}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sharegpt_speaker_names_and_malformed_rows(tmp_path):
    rows = [
        sharegpt_row(0),
        sharegpt_row(1, user="user", bot="chatgpt"),
        sharegpt_row(2, bot="bing"),
        sharegpt_row(3, bot="bard"),
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"},
                           {"from": "assistant", "value": "hello"}]},
        sharegpt_row(5, bot="robot"),  # unknown speaker
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]},  # empty turn
        {"conversations": [{"from": "human", "value": "hi"}]},  # nobody answers
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},  # missing text
        {"conversations": [{"value": "hi"}, {"from": "gpt", "value": "x"}]},  # missing speaker
        {"id": "no turns"},
        "not a dict",
        {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                           {"from": "gpt", "value": "c"}]},  # consecutive turns: dropped, never merged
        {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "x"}]},  # the assistant opens: dropped
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "system", "value": "be nice"},
                           {"from": "gpt", "value": "x"}]},  # a system turn in the middle: dropped
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"},
                           {"from": "human", "value": "and?"}]},  # ends with a user turn: kept
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.records_read == len(rows)
    assert out.report.kept == 6
    assert out.report.dropped == {"unknown_role": 1, "empty_turn": 1, "no_assistant_turn": 1, "missing_content": 1,
                                  "missing_role": 1, "missing_turns": 1, "not_an_object": 1,
                                  "roles_not_alternating": 1, "assistant_first": 1, "system_not_first": 1}
    roles = [[m.role for m in c.messages] for c in out.conversations]
    assert roles[:4] == [["user", "assistant"]] * 4
    assert roles[4] == ["system", "user", "assistant"]
    assert roles[5] == ["user", "assistant", "user"]
    assert [c.source_index for c in out.conversations] == [0, 1, 2, 3, 4, 15]
    # regeneration takes the prompt-only row as well (it answers it), and drops the same malformed rows
    regen = load_source(DataSourceConfig(path=str(path)), purpose="regenerate")
    assert regen.report.kept == 7 and "no_assistant_turn" not in regen.report.dropped
    assert regen.report.dropped["assistant_first"] == regen.report.dropped["system_not_first"] == 1


def test_truncated_sharegpt_file_keeps_complete_records(tmp_path):
    text = json.dumps([sharegpt_row(i) for i in range(5)], indent=2)
    cut = text.index('"r4"') + 10  # inside the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    out = load_source(DataSourceConfig(path=str(path)))
    assert [c.messages[1].content for c in out.conversations] == ["a0", "a1", "a2", "a3"]
    assert out.report.dropped == {"truncated_record": 1}
    # cut between records (no closing bracket): nothing partial to count
    between = text[: text.index("{", text.index('"r4"') - 20)]
    path.write_text(between)
    out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.kept == 4 and out.report.dropped == {}


def test_json_array_with_records_larger_than_the_read_buffer(tmp_path, monkeypatch):
    import dflash_trainer.data.json_records as json_records

    monkeypatch.setattr(json_records, "_CHUNK_CHARS", 64)
    rows = [sharegpt_row(i) | {"pad": "x" * 500} for i in range(6)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(rows))
    out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.kept == 6 and out.report.dropped == {}


def test_bundled_sharegpt_smoke():
    out = load_source(DataSourceConfig(path="sharegpt"), limit=50)
    assert out.report.kept == 50 and out.report.stopped_early
    assert out.report.records_read == 50 + sum(out.report.dropped.values())
    assert all(any(m.role == "assistant" for m in c.messages) for c in out.conversations)
    assert {m.role for c in out.conversations for m in c.messages} <= {"system", "user", "assistant"}


def test_jsonl_with_bad_lines_and_text_parts(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"messages": msgs(0)}) + "\n{not json\n\n"
        + json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": "c"}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                                   {"role": "assistant", "content": "c"}]}) + "\n"
    )
    out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.kept == 2
    assert out.report.dropped == {"invalid_json": 1, "images_not_read": 1}
    assert out.conversations[1].messages[0].content == "ab"


def test_parquet_and_save_to_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"messages": msgs(i)} for i in range(7)])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for path in ("d.parquet", "saved", "saved_dict"):
        out = load_source(DataSourceConfig(path=str(tmp_path / path)))
        assert [c.messages[1].content for c in out.conversations] == [f"answer {i}" for i in range(7)], path


def test_regenerate_directory_reads_all_shards(tmp_path):
    d = tmp_path / "regen"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    write_jsonl(d / "shard_00000.jsonl", [{"messages": msgs(i)} for i in range(3)])
    write_jsonl(d / "shard_00001.jsonl", [{"messages": msgs(i)} for i in range(3, 5)])
    write_jsonl(d / "failed.jsonl", [{"id": "x:1", "reason": "prompt too long"}])  # a log, not data
    out = load_source(DataSourceConfig(path=str(d)))
    assert out.report.dropped == {}
    assert [c.messages[0].content for c in out.conversations] == [f"question {i}" for i in range(5)]


def test_missing_path_and_unknown_directory_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist; fix data.path"):
        load_source(DataSourceConfig(path=str(tmp_path / "nope.json")))
    with pytest.raises(DataError, match="'sharegtp' does not exist \\(the bundled ShareGPT data is 'sharegpt'\\)"):
        load_source(DataSourceConfig(path="sharegtp"))
    with pytest.raises(DataError, match="the bundled ShareGPT data is 'sharegpt'"):
        load_source(DataSourceConfig(path="ShareGPT"))
    with pytest.raises(DataError, match="save_to_disk"):
        load_source(DataSourceConfig(path=str(tmp_path)))


def test_weighted_mix_follows_shares_and_seed(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": msgs(i)} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": msgs(100 + i)} for i in range(40)])
    cfg = DataConfig(sources=[DataSourceConfig(path=str(a), weight=2.0), DataSourceConfig(path=str(b), weight=1.0)],
                     max_conversations=30)
    out = load_conversations(cfg, seed=0)
    by_source = [c.source for c in out.conversations]
    assert by_source.count(str(a)) == 20 and by_source.count(str(b)) == 10
    assert out == load_conversations(cfg, seed=0)
    other = load_conversations(cfg, seed=1)
    assert [c.source_index for c in other.conversations] != [c.source_index for c in out.conversations]
    # no total: the scarcer source (relative to its weight) bounds the mix; the rest is counted, not lost silently
    cfg = DataConfig(sources=[DataSourceConfig(path=str(a), weight=1.0),
                              DataSourceConfig(path=str(b), weight=1.0, max_conversations=10)])
    out = load_conversations(cfg, seed=0)
    assert len(out.conversations) == 20 and out.report.dropped == {"not_selected_by_mix": 30}
    assert out.report.records_read == 50


def test_mix_counts():
    assert mix_counts([100, 100], [3.0, 1.0], 40) == [30, 10]
    assert mix_counts([10, 100], [1.0, 1.0], None) == [10, 10]


def test_a_jsonl_line_that_is_not_utf8_is_dropped_counted_and_named(tmp_path, caplog):
    """One latin-1 line among UTF-8 rows with accents: that line alone is left out (counted, warned about with
    its number); the others keep their text."""
    def row(text):
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "oui"}]}
    lines = [json.dumps(row(f"café {i}?"), ensure_ascii=False).encode("utf-8") for i in range(3)]
    lines.insert(1, json.dumps(row("thé?"), ensure_ascii=False).encode("latin-1"))
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING):
        out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.kept == 3 and out.report.dropped == {"not_utf8": 1}
    assert [c.messages[0].content for c in out.conversations] == ["café 0?", "café 1?", "café 2?"]
    assert any("1 lines are not UTF-8 (lines 2)" in r.getMessage() for r in caplog.records)


def test_non_utf8_files_and_empty_parquet_are_named_errors(tmp_path):
    """latin-1 text in a JSONL or a JSON array, and a 0-byte Parquet file: a DataError naming the file and the
    fix, never replacement characters trained on; a JSON array cut inside a multi-byte character still reads."""
    row = {"messages": [{"role": "user", "content": "café?"}, {"role": "assistant", "content": "oui"}]}
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes((json.dumps(row, ensure_ascii=False) + "\n").encode("latin-1"))
    array = tmp_path / "latin1.json"
    array.write_bytes(json.dumps([sharegpt_row(0), {"conversations": [
        {"from": "human", "value": "café?"}, {"from": "gpt", "value": "oui"}]}], ensure_ascii=False).encode("latin-1"))
    with pytest.raises(DataError, match=f"{jsonl}: not UTF-8 text \\(line 1 .*iconv -f latin1 -t utf-8"):
        load_source(DataSourceConfig(path=str(jsonl)))
    with pytest.raises(DataError, match=f"{array}: not UTF-8 text .*byte 0xe9.*iconv -f latin1 -t utf-8"):
        load_source(DataSourceConfig(path=str(array)))
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"{empty}: not a readable Parquet file"):
        load_source(DataSourceConfig(path=str(empty)))
    cut = tmp_path / "cut.json"
    text = json.dumps([sharegpt_row(0), {"conversations": [{"from": "human", "value": "é" * 20}]}], ensure_ascii=False)
    data = text.encode("utf-8")
    cut.write_bytes(data[: data.index("é".encode()) + 7])  # ends inside an é
    out = load_source(DataSourceConfig(path=str(cut)))
    assert out.report.kept == 1 and out.report.dropped == {"truncated_record": 1}


def test_a_byte_order_mark_costs_no_row(tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"messages": msgs(i)}) + "\n" for i in range(3)).encode())
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([sharegpt_row(i) for i in range(3)]).encode())
    for path in (jsonl, array):
        out = load_source(DataSourceConfig(path=str(path)))
        assert (out.report.kept, out.report.dropped) == (3, {}), path


def test_a_lone_surrogate_drops_its_row_counted_not_the_whole_source(tmp_path):
    path = tmp_path / "s.jsonl"
    bad = {"messages": [{"role": "user", "content": "broken \ud83d emoji"}, {"role": "assistant", "content": "x"}]}
    path.write_text(json.dumps({"messages": msgs(0)}) + "\n" + json.dumps(bad) + "\n"
                    + json.dumps({"messages": msgs(2)}) + "\n")  # json.dumps escapes it: "\\ud83d"
    out = load_source(DataSourceConfig(path=str(path)))
    assert out.report.kept == 2 and out.report.dropped == {"lone_surrogate": 1}
    assert [c.source_index for c in out.conversations] == [0, 2]


def test_rows_of_another_layout_name_the_columns_found_and_expected(tmp_path, caplog):
    """Most rows dropped for a layout reason: the warning (and a training start's error) names the columns, or the
    turn keys, found and the layouts expected, not a block-size hint; a few bad rows only count."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.prepare import prepare_data

    columns = tmp_path / "columns.jsonl"
    columns.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(16)))
    with caplog.at_level(logging.WARNING):
        report = load_source(DataSourceConfig(path=str(columns))).report
    assert report.dropped == {"missing_turns": 16}
    assert "16 of 16 rows dropped as missing_turns: the rows have the columns [prompt, response]" in caplog.text
    assert "expected a `messages` list of {role, content} turns" in caplog.text
    config = load_config("demo", [f"data.path={columns}", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataError, match=r"the rows have the columns \[prompt, response\]") as e:
        prepare_data(config, tmp_path / "run")
    assert "block_size" not in str(e.value)

    keys = tmp_path / "keys.jsonl"
    keys.write_text("".join(json.dumps({"messages": [{"speaker": "user", "text": "hi"},
                                                     {"speaker": "assistant", "text": "yo"}]}) + "\n" for _ in range(5))
                    + json.dumps({"messages": [{"role": "user", "content": "a"},
                                               {"role": "assistant", "content": "b"}]}) + "\n")
    report = load_source(DataSourceConfig(path=str(keys))).report
    assert report.kept == 1 and "5 of 6 rows dropped as missing_role: their turns have the keys [speaker, text]" in \
        report.layout_problem
    roles = tmp_path / "roles.jsonl"
    roles.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "model", "content": "yo"}]}) + "\n" for _ in range(3))
                     + json.dumps({"messages": [{"role": ["user"], "content": "hi"}]}) + "\n")  # unhashable role
    assert "3 of 4 rows dropped as unknown_role: their turns have the roles [model]" in \
        load_source(DataSourceConfig(path=str(roles))).report.layout_problem
    few = tmp_path / "few.jsonl"
    few.write_text(keys.read_text().splitlines()[0] + "\n" + "".join(keys.read_text().splitlines()[-1] + "\n"
                                                                    for _ in range(3)))
    assert load_source(DataSourceConfig(path=str(few))).report.layout_problem is None  # 1 of 4: a count only


def test_the_readme_data_format_example_loads_whole(tmp_path):
    """docs/data.md "Data format": its JSONL example is three usable conversations, as the text says."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    section = page.split("## Data format", 1)[1]
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "example.jsonl"
    path.write_text(example)
    loaded = load_source(DataSourceConfig(path=str(path)))
    assert loaded.report.kept == 3 and not loaded.report.dropped
    assert [m.role for m in loaded.conversations[1].messages] == ["system", "user", "assistant"]


def test_a_large_held_out_share_is_warned_about(tmp_path, caplog):
    """16 conversations with the demo recipe's 8 held out: the warning names the share and the setting."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.prepare import prepare_data

    rows = tmp_path / "small.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * 8},
                                                     {"role": "assistant", "content": f"answer {i} " * 30}]}) + "\n"
                            for i in range(16)))
    config = load_config("demo", [f"data.path={rows}", f"data.cache_dir={tmp_path / 'cache'}"])
    with caplog.at_level(logging.WARNING):
        prepared = prepare_data(config, tmp_path / "run")
    assert len(prepared.eval_conversations) == 8
    assert "8 of 16 usable conversations (50%) are held out for evaluation (data.num_eval_conversations=8)" in \
        caplog.text
    caplog.clear()
    config = load_config("demo", [f"data.path={rows}", f"data.cache_dir={tmp_path / 'cache'}",
                                  "data.num_eval_conversations=2"])
    with caplog.at_level(logging.WARNING):
        prepare_data(config, tmp_path / "run2")
    assert "held out for evaluation" not in caplog.text  # 2 of 16
