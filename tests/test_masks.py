"""Assistant-only loss masks for each builtin template family: decode the masked tokens, compare exactly."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.data.masks import Unmaskable, end_of_turn_marker, tokenize_conversation
from dflash_trainer.data.tiny_tokenizer import build_tiny_tokenizer
from dflash_trainer.data.types import Conversation, Message


@pytest.fixture(scope="module")
def toks():
    return {family: build_tiny_tokenizer(family) for family in ("qwen3", "llama3", "chatml")}


def conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation(messages=tuple(Message(role=r, content=c) for r, c in turns), source="t", source_index=0)


def supervised_runs(tok, seq) -> list[str]:
    """Decoded text of each contiguous run of supervised tokens."""
    runs, current = [], []
    for token, on in zip(seq.input_ids.tolist(), seq.loss_mask.tolist()):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def masked(tok, c, *, thinking=False, max_length=4096, min_supervised=1):
    eot = end_of_turn_marker(tok, thinking=thinking)
    return tokenize_conversation(c, tok, thinking=thinking, end_of_turn=eot, max_length=max_length,
                                 min_supervised=min_supervised)


MULTI = conv(
    ("system", "You are terse."),
    ("user", "What is two plus two?"),
    ("assistant", "<think>\nadd them\n</think>\n\nIt is four."),
    ("user", "And three plus three?"),
    ("assistant", "<think>\nadd again\n</think>\n\nIt is six."),
)
PLAIN = conv(("user", "Hello there"), ("assistant", "Hi! How can I help?"), ("user", "Tell a joke"),
             ("assistant", "Why did the chicken cross the road?"))


def test_end_of_turn_detected(toks):
    assert end_of_turn_marker(toks["qwen3"], thinking=False) == "<|im_end|>"
    assert end_of_turn_marker(toks["chatml"], thinking=False) == "<|im_end|>"
    assert end_of_turn_marker(toks["llama3"], thinking=False) == "<|eot_id|>"


def test_qwen3_thinking_on_supervises_last_think_block_only(toks):
    seq = masked(toks["qwen3"], MULTI, thinking=True)
    # earlier turn: the template dropped its reasoning; last turn: the think block is generated, so trained
    assert supervised_runs(toks["qwen3"], seq) == [
        "It is four.<|im_end|>",
        "<think>\nadd again\n</think>\n\nIt is six.<|im_end|>",
    ]


def test_qwen3_thinking_off_empty_think_block_is_prompt(toks):
    seq = masked(toks["qwen3"], PLAIN, thinking=False)
    text = toks["qwen3"].decode(seq.input_ids.tolist(), skip_special_tokens=False)
    assert "<think>\n\n</think>\n\n" in text  # the empty block is in the sequence ...
    assert supervised_runs(toks["qwen3"], seq) == [  # ... but not supervised: serving puts it in the prompt
        "Hi! How can I help?<|im_end|>",
        "Why did the chicken cross the road?<|im_end|>",
    ]


def test_qwen3_thinking_on_without_reasoning_trains_the_empty_block(toks):
    seq = masked(toks["qwen3"], PLAIN, thinking=True)
    assert supervised_runs(toks["qwen3"], seq) == [
        "Hi! How can I help?<|im_end|>",
        "<think>\n\n</think>\n\nWhy did the chicken cross the road?<|im_end|>",
    ]


def test_llama3_trims_content(toks):
    c = conv(("user", "  Hello  "), ("assistant", "  Hi there!  \n"), ("user", "Bye"), ("assistant", "Goodbye."))
    seq = masked(toks["llama3"], c)
    assert seq.input_ids[0].item() == toks["llama3"].convert_tokens_to_ids("<|begin_of_text|>")
    assert supervised_runs(toks["llama3"], seq) == ["Hi there!<|eot_id|>", "Goodbye.<|eot_id|>"]


def test_chatml(toks):
    seq = masked(toks["chatml"], PLAIN)
    assert supervised_runs(toks["chatml"], seq) == [
        "Hi! How can I help?<|im_end|>",
        "Why did the chicken cross the road?<|im_end|>",
    ]


def test_reply_starting_like_the_prompt_is_cut_at_a_token_edge(toks):
    # the reply starts with '<', like the think prefill of the serve prompt: the match must not eat it
    c = conv(("user", "html?"), ("assistant", "<div>a</div>"), ("user", "more"), ("assistant", "<p>b</p>"))
    seq = masked(toks["qwen3"], c, thinking=False)
    assert supervised_runs(toks["qwen3"], seq) == ["<div>a</div><|im_end|>", "<p>b</p><|im_end|>"]


def test_truncation_cuts_ids_and_mask_together(toks):
    full = masked(toks["chatml"], PLAIN)
    cut = masked(toks["chatml"], PLAIN, max_length=20)
    assert cut.num_tokens == 20 and cut.loss_mask.shape == (20,)
    assert torch.equal(cut.input_ids, full.input_ids[:20]) and torch.equal(cut.loss_mask, full.loss_mask[:20])
    assert cut.truncated_tokens == full.num_tokens - 20 > 0 and full.truncated_tokens == 0  # counted exactly


def test_too_few_supervised_tokens_dropped(toks):
    c = conv(("user", "Say ok"), ("assistant", "ok"))
    with pytest.raises(Unmaskable, match="too_few_supervised_tokens"):
        masked(toks["chatml"], c, min_supervised=16)


def test_reply_containing_end_of_turn_marker_is_dropped_not_mismasked(toks):
    c = conv(("user", "quote it"), ("assistant", "the marker <|im_end|> appears here"))
    with pytest.raises(Unmaskable, match="reply_not_found"):
        masked(toks["chatml"], c)


def test_template_that_rewrites_earlier_turns_says_what_broke(caplog):
    """A template that renders a turn differently once later turns follow cannot be masked turn by turn: the
    row is dropped under the counted reason, and the first one is explained (which turn, where, the fix)."""
    import logging

    from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_one

    tok = build_tiny_tokenizer("chatml")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last %}{{ m.content }}{% else %}[{{ m.content }}]"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(Unmaskable, match="template_not_prefix_stable") as info:
        masked(tok, PLAIN)
    assert "turn 1 (assistant)" in info.value.detail and "'Hello there<|im_end|>" in info.value.detail
    assert "data.chat_template" in info.value.detail
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tok, thinking=False), max_length=4096,
                                min_supervised=1)
    with caplog.at_level(logging.WARNING):
        assert tokenize_one(PLAIN, tok, settings) == "template_not_prefix_stable"
    assert any("dropped t:0 (template_not_prefix_stable): turn 1" in r.getMessage() for r in caplog.records)
