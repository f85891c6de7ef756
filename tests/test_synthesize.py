"""`dflash-train synthesize`: the user-turn prefix found from templates, the filters and dedup, the runner
(reasons counted, multi-turn, resume, a second writer), the tiny target end to end, the OpenAI backend, mixing."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai_server import Behaviour, FakeServer

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.data.templates import builtin_template
from dflash_trainer.data.tiny_tokenizer import build_tiny_tokenizer
from dflash_trainer.data.types import Message
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.regen import read_manifest, read_rows
from dflash_trainer.regen.settings import check_regen_settings
from dflash_trainer.regen.turns import Continuation
from dflash_trainer.synth.config import SynthesizeConfig
from dflash_trainer.synth.filters import Deduplicator, NearDuplicates, TurnFilter, jaccard, shingles
from dflash_trainer.synth.runner import synthesize
from dflash_trainer.synth.store import SynthStore, synth_settings
from dflash_trainer.synth.template import SENTINEL, find_user_turns

ROOT = Path(__file__).resolve().parents[1]
TINY = ["target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu",
        "logging.progress=false"]

HARMONY = (  # shaped like gpt-oss's: a fixed system block, the system message as the developer's, channels
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model.\\nReasoning: medium<|end|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- '<|start|>developer<|message|># Instructions\\n\\n' + m['content'] + '<|end|>' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def tokenizer_with(template: str, family: str = "qwen3"):
    tok = copy.deepcopy(build_tiny_tokenizer(family))
    tok.chat_template = template
    return tok


# ---------------------------------------------------------------- the user-turn prefix


@pytest.mark.parametrize("name, system, prefix, end, header, assistant", [
    ("chatml", "Be brief.", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", "<|im_end|>",
     "<|im_start|>user", "<|im_start|>assistant"),
    ("llama3", None, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>",
     "<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    ("qwen3", None, "<|im_start|>user\n", "<|im_end|>", "<|im_start|>user",
     "<|im_start|>assistant\n<think>\n\n</think>"),
], ids=["chatml", "llama3", "qwen3"])
def test_the_user_turn_is_found_from_builtin_templates(name, system, prefix, end, header, assistant):
    tok = tokenizer_with(builtin_template(name), "llama3" if name == "llama3" else "qwen3")
    turns = find_user_turns(tok, template=name, thinking=False, system_prompt=system)
    assert turns.prefix(turns.system) == prefix
    assert turns.end_of_turn == end and turns.end_token_ids == (tok.get_vocab()[end],)
    assert header in turns.markers and assistant in turns.markers
    assert "<|im_start|>" in turns.markers and "<|eot_id|>" in turns.markers  # the tokenizer's special tokens
    # a later turn: the conversation so far, rendered, then the opening of the next user turn
    so_far = (*turns.system, Message(role="user", content="hi there"), Message(role="assistant", content="Hello!"))
    later = turns.prefix(so_far)
    opening = prefix.rsplit(end, 1)[-1].lstrip("\n").removeprefix(tok.bos_token or "")  # the user header alone
    assert later.startswith(prefix) and later.endswith(end + ("\n" if name != "llama3" else "") + opening)
    assert later.count(opening) == 2 and "Hello!" in later


def test_qwen3_thinking_on_and_off_share_the_prefix():
    tok = tokenizer_with(builtin_template("qwen3"))
    on = find_user_turns(tok, template="qwen3", thinking=True, system_prompt=None)
    off = find_user_turns(tok, template="qwen3", thinking=False, system_prompt=None)
    assert on.prefix(()) == off.prefix(()) == "<|im_start|>user\n" and on.end_of_turn == off.end_of_turn


def test_a_harmony_template_has_its_user_turn_found():
    tok = tokenizer_with(HARMONY)
    tok.add_tokens(["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"], special_tokens=True)
    turns = find_user_turns(tok, template="harmony", thinking=False, system_prompt="Answer in French.")
    assert turns.prefix(turns.system) == ("<|start|>system<|message|>You are ChatGPT, a large language model.\n"
                                          "Reasoning: medium<|end|><|start|>developer<|message|># Instructions\n\n"
                                          "Answer in French.<|end|><|start|>user<|message|>")
    assert turns.end_of_turn == "<|end|>" and turns.end_token_ids == (tok.convert_tokens_to_ids("<|end|>"),)
    assert {"<|start|>user<|message|>", "<|start|>assistant", "<|channel|>"} <= set(turns.markers)


@pytest.mark.parametrize("family, end", [
    ("gemma3", "<end_of_turn>"), ("gemma4", "<turn|>"), ("llama4", "<|eot|>"), ("deepseek-v3", "<｜Assistant｜>"),
    ("glm4-moe", "<|assistant|>"), ("minimax-m2", "[e~["), ("nemotron-h", "<|im_end|>"), ("qwen3.5", "<|im_end|>"),
    ("kimi-k2", "<|im_end|>"),
])
@pytest.mark.parametrize("thinking", [False, True])
def test_every_familys_own_template_ends_a_user_turn_at_one_special_token(family, end, thinking):
    """A template that closes no user turn (DeepSeek-V3, GLM-4.5) ends one at its generation prompt's first special
    token, which the target writes next; never at template text such as GLM's `/nothink` or two tokens joined."""
    tok = build_tiny_tokenizer(family)
    turns = find_user_turns(tok, template=family, thinking=thinking, system_prompt=None)
    assert turns.end_of_turn == end and turns.end_token_ids == (tok.convert_tokens_to_ids(end),)


@pytest.mark.parametrize("template, message", [
    ("{%- for m in messages -%}{%- if m['role'] != 'user' -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}<|im_end|>",
     "has no user turn"),
    ("{{ raise_exception('only assistant turns here') }}", r"fails to render .*only assistant turns here"),
    ("{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}", "writes nothing after a user message"),
], ids=["no-user-turn", "raises", "no-end"])
def test_a_template_without_a_usable_user_turn_is_named_with_the_fix(template, message):
    with pytest.raises(ConfigError, match=message) as e:
        find_user_turns(tokenizer_with(template), template="data.chat_template=odd.jinja", thinking=False,
                        system_prompt=None)
    assert "data.chat_template=odd.jinja" in str(e.value) and "set data.chat_template" in str(e.value)
    assert SENTINEL not in str(e.value)


# ---------------------------------------------------------------- filters and dedup


def test_each_turn_filter_reason():
    config = SynthesizeConfig(min_chars=10, max_chars=60, max_tokens=8)
    turn_filter = TurnFilter(config, markers=("<|im_start|>", "<|im_end|>"), system_prompt="You are a helpful bot.",
                             count_tokens=lambda text: len(text.split()))

    def reason(text: str, finished: bool = True) -> str | None:
        problem = turn_filter.problem(Continuation(text=text, finished=finished))
        return None if problem is None else problem.reason

    assert reason("How do I bake sourdough bread?") is None
    assert reason(" \n\t ") == "empty"
    assert reason("How do I bake sourdough", finished=False) == "truncated"
    assert reason("hello<|im_start|>assistant\nsure") == "template"
    assert reason("you are a HELPFUL bot") == "template"  # the system prompt again
    assert reason("Hi there") == "too_short"
    assert reason("Tell me " + "much more " * 30) == "too_long"  # characters
    assert reason("one two three four five six seven eight nine") == "too_long"  # tokens
    assert reason("Go", finished=False) == "truncated"  # the first reason in order is the one counted
    kept = TurnFilter(SynthesizeConfig(keep_truncated=True), markers=(), system_prompt=None)
    assert kept.problem(Continuation(text="How do I bake sourdough", finished=False)) is None


DISTINCT = [
    "How do I bake sourdough bread at home?", "What is the capital of France?", "What is the capital of Spain?",
    "Write a haiku about autumn rain.", "Explain quantum tunnelling to a ten year old.",
    "Can you help me plan a budget for a trip to Japan?", "Summarise the plot of Hamlet in three sentences.",
    "Why is the sky blue?", "Give me a Python function that reverses a linked list.",
    "What are the health benefits of green tea?", "How does compound interest work?",
    "Translate 'good morning' into German and Italian.", "Suggest names for a bakery that sells vegan cakes.",
    "What causes inflation, and how do central banks respond?", "Write a cover letter for a junior data analyst.",
]


def test_dedup_drops_exact_and_lightly_edited_copies_and_keeps_distinct_prompts():
    dedup = Deduplicator(0.7)
    assert all(dedup.problem(p) is None for p in DISTINCT)
    assert dedup.problem("how do i bake SOURDOUGH bread at home").reason == "duplicate"
    edited = dedup.problem("Can you help me plan a budget for a trip to Japan next spring?")
    assert edited.reason == "near_duplicate" and "Jaccard" in edited.detail
    assert dedup.problem("Write a limerick about a cat who loves jazz.") is None
    off = Deduplicator(None)  # exact duplicates only
    assert off.problem(DISTINCT[5]) is None and off.problem(DISTINCT[5] + " next spring") is None
    assert off.problem(DISTINCT[5].upper()).reason == "duplicate"


def test_near_duplicates_match_a_brute_force_search():
    """MinHash + LSH finds what comparing every pair finds (nothing under the threshold is ever reported)."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    bases = [[rng.choice(words) for _ in range(rng.randint(8, 25))] for _ in range(80)]
    texts = []
    for base in bases:
        texts.append(" ".join(base))
        for _ in range(2):
            edited = list(base)
            for _ in range(rng.randint(1, 4)):
                edited[rng.randrange(len(edited))] = rng.choice(words)
            texts.append(" ".join(edited))
    rng.shuffle(texts)
    for threshold in (0.5, 0.7, 0.9):
        fast, kept, slow = NearDuplicates(threshold), [], []
        for text in texts:
            found = fast.add_if_new(text) is not None
            best = max((jaccard(shingles(text), k) for k in kept), default=0.0)
            slow.append(best >= threshold)
            if not found:
                kept.append(shingles(text))
            assert found == slow[-1], (threshold, text)
        assert 0 < sum(slow) < len(texts)


# ---------------------------------------------------------------- the runner (a scripted writer)


class ScriptedWriter:
    """User turn t of attempt k is `turns[t](k)`; answers are `re:<last user turn>` (or `answer(messages)`)."""

    def __init__(self, *turns, answer=None, stop_at: int | None = None) -> None:
        self.turns = turns
        self.answer_fn = answer or (lambda messages: f"re:{messages[-1].content}")
        self.stop_at = stop_at
        self.keys: list[str] = []

    def write_turns(self, prefixes, keys):
        self.keys += keys
        out = []
        for key in keys:
            attempt, turn = int(key.split(":")[1].split("/")[0]), int(key.rsplit("user", 1)[1])
            if self.stop_at is not None and attempt >= self.stop_at:
                raise KeyboardInterrupt
            text = self.turns[turn](attempt)
            out.append(text if isinstance(text, Continuation) else Continuation(text=text, finished=True))
        return out

    def answer(self, conversations, keys):
        return [self.answer_fn(messages) for messages in conversations]


def words_of(k: int) -> str:
    """A distinct opening per k (random words: no two are near duplicates)."""
    rng = random.Random(k)
    return "Tell me about " + " ".join(f"w{rng.randrange(1000)}" for _ in range(8))


def run_scripted(out, writer, *overrides, tokenizer=None):
    config = load_config(None, [*TINY, *overrides])
    turns = find_user_turns(tokenizer or build_tiny_tokenizer("qwen3"), template="qwen3", thinking=False,
                            system_prompt=config.synthesize.system_prompt)
    return synthesize(writer=writer, turns=turns, config=config.synthesize, settings=synth_settings(config),
                      out_dir=out, progress=False)


def test_every_drop_reason_is_counted_and_logged(tmp_path):
    script = [
        "How do I bake sourdough bread at home?",
        "   ",
        Continuation(text="Explain quantum tunnelling to a child", finished=False),
        "<|im_start|>user\nhello there friend",
        "Be brief.",  # the system prompt
        "Hi",
        "x" * 100,
        "how do i bake SOURDOUGH bread at home",
        "How do I bake sourdough bread at home quickly?",
        "What are the main causes of inflation in 2024?",
    ]
    summary = run_scripted(tmp_path, ScriptedWriter(lambda k: script[k]), "synthesize.num_prompts=2",
                           "synthesize.batch_size=10", "synthesize.max_chars=80", "synthesize.system_prompt=Be brief.")
    expected = {"empty": 1, "truncated": 1, "template": 2, "too_short": 1, "too_long": 1, "duplicate": 1,
                "near_duplicate": 1}
    assert summary.dropped == expected and (summary.kept, summary.attempts) == (2, 10)
    manifest = read_manifest(tmp_path)
    assert manifest["rows_skipped"] == expected and manifest["synthesize"]["dropped"] == expected
    assert manifest["complete"] is True and manifest["settings"]["synthesize.system_prompt"] == "Be brief."
    rows = {r["id"]: r["messages"] for r in read_rows(tmp_path)}
    assert set(rows) == {"synth:0", "synth:9"}
    assert [m["role"] for m in rows["synth:0"]] == ["system", "user", "assistant"]
    assert rows["synth:9"][1]["content"] == script[9] and rows["synth:9"][2]["content"] == f"re:{script[9]}"
    failed = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "failed.jsonl").read_text().splitlines()}
    assert failed["synth:8"]["skipped"] == "near_duplicate" and "Jaccard" in failed["synth:8"]["reason"]


def test_multi_turn_conversations_and_a_later_turn_dropped_cuts_the_conversation(tmp_path):
    writer = ScriptedWriter(words_of, lambda k: "" if k == 1 else f"And what about {words_of(k + 100)}?")
    summary = run_scripted(tmp_path, writer, "synthesize.num_prompts=3", "synthesize.num_turns=2")
    rows = {r["id"]: r for r in read_rows(tmp_path)}
    assert [m["role"] for m in rows["synth:0"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert rows["synth:0"]["messages"][3]["content"] == "re:" + rows["synth:0"]["messages"][2]["content"]
    assert [m["role"] for m in rows["synth:1"]["messages"]] == ["user", "assistant"] and rows["synth:1"]["cut"] == "empty"
    assert summary.cut == {"empty": 1} and summary.kept == 3
    prompts_only = run_scripted(tmp_path / "p", ScriptedWriter(words_of, words_of), "synthesize.num_prompts=2",
                                "synthesize.num_turns=2", "synthesize.answer=false")
    assert prompts_only.kept == 2
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "user"] for r in read_rows(tmp_path / "p"))


def test_resume_after_an_interruption_continues_without_duplicates(tmp_path):
    args = ("synthesize.num_prompts=12", "synthesize.batch_size=4")
    with pytest.raises(KeyboardInterrupt):
        run_scripted(tmp_path, ScriptedWriter(words_of, stop_at=8), *args)
    assert len(list(read_rows(tmp_path))) == 8
    # training on the unfinished output is warned about with the command that finishes it
    partial = check_regen_settings(tmp_path, thinking=False, temperature=0.0)
    assert any("partial synthesize output" in w and f"dflash-train synthesize --out {tmp_path}" in w for w in partial)
    with open(tmp_path / "shard_00000.jsonl", "a") as f:
        f.write('{"messages": [{"role": "user", "content": "half a ro')  # killed mid-write
    again = ScriptedWriter(lambda k: words_of(0) if k == 8 else words_of(k))  # attempt 8 repeats a kept opening
    summary = run_scripted(tmp_path, again, *args)
    ids = [r["id"] for r in read_rows(tmp_path)]
    openings = [r["messages"][0]["content"] for r in read_rows(tmp_path)]
    assert len(ids) == 12 == len(set(ids)) == len(set(openings))
    assert min(int(k.split(":")[1].split("/")[0]) for k in again.keys) == 8  # no attempt made twice
    assert summary.dropped == {"duplicate": 1} and summary.new == 4 and read_manifest(tmp_path)["complete"]
    more = run_scripted(tmp_path, ScriptedWriter(words_of), "synthesize.num_prompts=14", "synthesize.batch_size=4")
    assert (more.kept, more.new) == (14, 2)  # a larger number adds to the output


def test_a_second_writer_and_other_settings_are_refused(tmp_path):
    run_scripted(tmp_path, ScriptedWriter(words_of), "synthesize.num_prompts=2")
    config = load_config(None, TINY)
    holder = SynthStore.open(tmp_path, settings=synth_settings(config), shard_rows=4, source={}, expected_ids=set(),
                             wanted=2, max_attempts=20)
    try:
        with pytest.raises(DataError, match="another `dflash-train synthesize` is writing"):
            run_scripted(tmp_path, ScriptedWriter(words_of), "synthesize.num_prompts=3")
    finally:
        holder.close()
    with pytest.raises(DataError, match=r"synthesize.temperature: the directory has 1.0, this run asks for 0.5.*"
                                        r"new --out"):
        run_scripted(tmp_path, ScriptedWriter(words_of), "synthesize.num_prompts=3", "synthesize.temperature=0.5")
    assert len(list(read_rows(tmp_path))) == 2


def test_config_is_validated():
    for override, message in (("synthesize.temperature=0", "synthesize.temperature must be > 0"),
                              ("synthesize.near_dup_threshold=1.5", "near_dup_threshold must be in"),
                              ("synthesize.max_attempts=3", "max_attempts .* must be >= synthesize.num_prompts"),
                              ("synthesize.max_chars=5", "max_chars .* must be >= synthesize.min_chars")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*TINY, override])
    assert load_config(None, TINY).synthesize.attempts_cap == 10_000


# ---------------------------------------------------------------- the tiny target, end to end


def test_synthesize_on_the_demo_target_then_regenerate_and_plan_read_it(tmp_path, capsys):
    out = tmp_path / "synth"
    small = ["synthesize.num_prompts=6", "synthesize.num_turns=2", "synthesize.max_new_tokens=12",
             "synthesize.keep_truncated=true", "regenerate.max_new_tokens=8", "logging.progress=false",
             f"data.cache_dir={tmp_path / 'tok'}"]
    assert cli.main(["synthesize", "--config", "demo", "--out", str(out), *small]) == 0
    printed = capsys.readouterr().out
    assert "6 conversations kept (6 new) of 6 wanted" in printed and f"data.path={out}" in printed
    rows = list(read_rows(out))
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["user", "assistant", "user", "assistant"])
        assert ("cut" in row) == (len(roles) == 2)
    manifest = read_manifest(out)
    assert manifest["settings"]["model"] == "random_init=tiny" and manifest["source"]["synthesize"]["end_of_turn"] == "<|im_end|>"
    assert manifest["synthesize"]["attempts"] == 6 + sum(manifest["rows_skipped"].values())
    assert cli.main(["synthesize", "--config", "demo", "--out", str(out), *small]) == 0  # done: nothing to add
    assert "6 conversations kept (0 new)" in capsys.readouterr().out
    answers = tmp_path / "answers"
    assert cli.main(["regenerate", "--config", "demo", "--out", str(answers), f"data.path={out}", *small]) == 0
    assert len(list(read_rows(answers))) == 6
    assert cli.main(["plan", "--config", "demo", f"data.path={out}", f"run.dir={tmp_path / 'plan'}",
                     "data.num_eval_conversations=2", *small]) == 0
    summary = json.loads((tmp_path / "plan" / "plan" / "summary.json").read_text())
    assert summary["conversations_kept"] == 4 and summary["dropped"] == {}


def test_the_local_backend_is_warned_about_long_replies(caplog):
    from dflash_trainer.commands.regenerate import build_backend

    with caplog.at_level(logging.WARNING, logger="dflash_trainer.commands.regenerate"):
        build_backend(load_config(None, [*TINY, "regenerate.max_new_tokens=512"]))
        assert not [r for r in caplog.records if r.name == "dflash_trainer.commands.regenerate"]
        build_backend(load_config(None, [*TINY, "regenerate.max_new_tokens=16384"]))
    [record] = [r for r in caplog.records if r.name == "dflash_trainer.commands.regenerate"]
    assert "slow" in record.message and "regenerate.backend=openai regenerate.url=" in record.message


# ---------------------------------------------------------------- the OpenAI-compatible backend


def test_the_openai_backend_writes_turns_through_the_completions_endpoint(tmp_path, capsys):
    from dflash_trainer.commands import synthesize as command

    def completion(body):  # every third seed runs out of tokens
        text, _ = Behaviour().completion(body)
        return text, "length" if body["seed"] % 3 == 0 else "stop"

    with FakeServer(Behaviour(completion=completion)) as server:
        config = load_config(None, [*TINY, "regenerate.backend=openai", f"regenerate.url={server.url}",
                                    "regenerate.model=tiny-model", "regenerate.retry_backoff_s=0.01",
                                    "synthesize.num_prompts=5", "synthesize.num_turns=2", "synthesize.top_p=0.9"])
        assert command.run(config, argparse.Namespace(out=str(tmp_path))) == 0
        requests = list(server.behaviour.requests)
    texts = [r for r in requests if "prompt" in r]
    chats = [r for r in requests if "messages" in r]
    tok = build_tiny_tokenizer("qwen3")
    first = [r for r in texts if r["prompt"] == tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]]
    assert first and all(r["stop"] == ["<|im_end|>"] and r["stop_token_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
                         and r["skip_special_tokens"] is False and r["top_p"] == 0.9 and r["temperature"] == 1.0
                         for r in texts)
    assert len({r["seed"] for r in texts}) == len(texts)
    later = [tok.decode(r["prompt"]) for r in texts if r not in first]
    assert later and all("re:Tell me about" in p and p.endswith("<|im_start|>user\n") for p in later)
    rows = list(read_rows(tmp_path))
    assert len(rows) == 5 and chats
    for row in rows:
        messages = row["messages"]
        assert messages[1]["content"] == "re:" + messages[0]["content"]
    manifest = read_manifest(tmp_path)
    assert manifest["rows_skipped"]["truncated"] >= 1 and manifest["settings"]["backend"] == "openai"
    assert "5 conversations kept (5 new)" in capsys.readouterr().out


def test_a_server_without_the_completions_endpoint_is_an_error(tmp_path):
    from dflash_trainer.commands import synthesize as command

    with FakeServer(Behaviour(completions_404=True)) as server:
        config = load_config(None, [*TINY, "regenerate.backend=openai", f"regenerate.url={server.url}",
                                    "regenerate.model=tiny-model", "synthesize.num_prompts=3"])
        with pytest.raises(DataError, match=r"wrote no conversation .*: of 30 openings sampled, dropped none; 30 failed "
                                            r"\(HTTP 404: 30; details in .*failed.jsonl\).*regenerate.url and "
                                            r"regenerate.model"):
            command.run(config, argparse.Namespace(out=str(tmp_path)))


# ---------------------------------------------------------------- mixing, the diversity bench


def test_a_synthesized_dataset_mixes_with_other_data_by_weight(tmp_path):
    from dflash_trainer.data.config import DataConfig, DataSourceConfig
    from dflash_trainer.data.sources import load_conversations

    synth = tmp_path / "synth"
    run_scripted(synth, ScriptedWriter(words_of), "synthesize.num_prompts=6")
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"my question {i}"},
                                                    {"role": "assistant", "content": "my answer"}]}) + "\n"
                           for i in range(12)))
    mix = DataConfig(sources=[DataSourceConfig(path=str(synth), weight=1.0), DataSourceConfig(path=str(own), weight=2.0)],
                     max_conversations=9)
    loaded = load_conversations(mix, seed=0)
    by_source = {s: sum(c.source == s for c in loaded.conversations) for s in (str(synth), str(own))}
    assert by_source == {str(synth): 3, str(own): 6}
    assert all(c.messages[0].content.startswith("Tell me about") for c in loaded.conversations if c.source == str(synth))


def test_the_diversity_bench_prints_distinct_n_and_duplicate_rates(tmp_path):
    synth = tmp_path / "synth"
    run_scripted(synth, ScriptedWriter(words_of), "synthesize.num_prompts=3")
    reference = tmp_path / "reference.jsonl"
    reference.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                                 for p in ("a b c", "A b, c!", "a b d")))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "synthesize" / "synthesize_diversity.py"), str(synth),
                           str(reference), "--out", str(tmp_path / "results")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = list((tmp_path / "results").glob("*-synthesize-diversity.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == result
    ours, ref = result["sets"]
    assert result["prompts_per_set"] == 3 and ours["exact_dup_rate"] == 0 and ours["distinct_1"] > 0
    assert ref["distinct_1"] == pytest.approx(4 / 9) and ref["distinct_2"] == pytest.approx(3 / 6)
    assert ref["exact_dup_rate"] == pytest.approx(1 / 3) and ref["near_dup_rate"] == pytest.approx(1 / 3)
    # at equal words: each set cut to the smaller word count (here the reference's 9: "a b c a b c a b d")
    assert ref["words"] == ours["words"] == 9 and ref["d1@W"] == pytest.approx(4 / 9)
    assert ours["d1@W"] == pytest.approx(len(set(" ".join(words_of(k) for k in range(3)).split()[:9])) / 9)
