"""Each target family's own chat format (`tiny:<family>`: the family's special tokens and its chat template, written
from the published one): the loss masks supervise exactly each assistant reply through the token that ends it at serve
time, checked against a slow reference that tokenizes each serve prompt and the conversation apart; the generation
prompt is never supervised; a reply the target writes in `regenerate` (a scripted target, through the local backend's
own prompt, stop tokens and think-block prefix) is supervised token for token as written, its end of turn included;
`eval`'s stop tokens are the family's. Training and `eval` on each family's tiny preset with its tokenizer:
test_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_trainer.data.masks import TurnEnds, Unmaskable, render, tokenize_conversation, turn_ends
from dflash_trainer.data.tiny_tokenizer import TINY_CHAT_TOKENS, build_tiny_tokenizer
from dflash_trainer.data.tokenized import tokenize_all
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.target.stop_tokens import stop_token_ids

FAMILIES = {  # tokenizer: (the token that ends a reply, whether the template writes it after the final reply,
    #                        the tokens decoding stops at: the family's eos and end of turn)
    "gemma3": ("<end_of_turn>", True, {"<eos>", "<end_of_turn>"}),
    "gemma4": ("<turn|>", True, {"<eos>", "<turn|>"}),
    "llama4": ("<|eot|>", True, {"<|eot|>", "<|end_of_text|>"}),
    "deepseek-v3": ("<｜end▁of▁sentence｜>", True, {"<｜end▁of▁sentence｜>"}),
    "glm4-moe": ("<|user|>", False, {"<|endoftext|>", "<|user|>"}),  # no closing token: the next turn's opening
    "minimax-m2": ("[e~[", True, {"[e~["}),
    "nemotron-h": ("<|im_end|>", True, {"<|im_end|>"}),
    "qwen3.5": ("<|im_end|>", True, {"<|im_end|>", "<|endoftext|>"}),
    "kimi-k2": ("<|im_end|>", True, {"<|im_end|>", "[EOS]"}),
}
DROPS_REASONING = {"deepseek-v3", "gemma4"}
"""Families whose template renders the final reply without its reasoning (DeepSeek-V3.1's `<think>` block, Gemma 4's
thought channel): refused with thinking on."""
PROMPT_NOT_RENDERED = {("gemma4", False)}
"""Where the generation prompt is not what the template renders before a reply: Gemma 4's thinking-off prompt holds an
empty thought channel that no rendered reply has (the reply's own tokens are still the target's)."""


@pytest.fixture(scope="module")
def toks():
    return {family: build_tiny_tokenizer(family) for family in FAMILIES}


def conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation(messages=tuple(Message(role=r, content=c) for r, c in turns), source="t", source_index=0)


PLAIN = conv(("user", "Hello there"), ("assistant", "Hi! How can I help?"), ("user", "Tell a joke"),
             ("assistant", "Why did the chicken cross the road?"))
MULTI = conv(("system", "You are terse."), ("user", "What is two plus two?"),
             ("assistant", "<think>\nadd them\n</think>\n\nIt is four."), ("user", "And three plus three?"),
             ("assistant", "<think>\nadd again\n</think>\n\nIt is six."))
SINGLE = conv(("system", "Be brief."), ("user", "Name a color."), ("assistant", "Blue, like the sky at noon."))
CONVERSATIONS = {"plain": PLAIN, "multi": MULTI, "single": SINGLE}


def masked(tok, c: Conversation, *, thinking: bool):
    return tokenize_conversation(c, tok, thinking=thinking, end_of_turn=turn_ends(tok, thinking=thinking),
                                 max_length=4096, min_supervised=1)


def reference(tok, c: Conversation, *, thinking: bool, marker: str, closes: bool) -> tuple[list[int], list[bool]]:
    """Slow reference, by hand: the whole conversation rendered and tokenized (the marker appended after the final
    reply when the template writes none there); for each reply, its serve prompt (the turns before it and the
    generation prompt) tokenized alone: the reply's tokens start where the two token lists part and end with the first
    marker token after that."""
    full = render(tok, c.messages, thinking=thinking) + ("" if closes else marker)
    ids = tok(full, add_special_tokens=False)["input_ids"]
    marker_id = tok.convert_tokens_to_ids(marker)
    mask = [False] * len(ids)
    for i, message in enumerate(c.messages):
        if message.role != "assistant" or i == 0:
            continue
        prompt = tok(render(tok, c.messages[:i], thinking=thinking, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        start = next(k for k, (a, b) in enumerate(zip(prompt + [None], ids)) if a != b)
        end = ids.index(marker_id, start)
        mask[start:end + 1] = [True] * (end + 1 - start)
    return ids, mask


def runs(tok, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded text of each contiguous run of supervised tokens."""
    found, current = [], []
    for token, on in zip(ids + [None], mask + [False]):
        if on:
            current.append(token)
        elif current:
            found.append(tok.decode(current, skip_special_tokens=False))
            current = []
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_and_stop_tokens_are_the_familys(family, toks):
    tok = toks[family]
    marker, closes, stops = FAMILIES[family]
    for thinking in (False, True):
        assert turn_ends(tok, thinking=thinking) == TurnEnds(inner=marker, final=marker, appended=not closes)
    target = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))  # the tiny presets declare none
    assert set(tok.convert_ids_to_tokens(stop_token_ids(tok, target))) == stops
    generic = {"<|im_start|>", "<|eot_id|>", "<|start_header_id|>"} - set(TINY_CHAT_TOKENS[family].tokens)
    assert not generic & set(tok.get_vocab())  # no other family's structure tokens


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_masks_supervise_each_reply_through_its_end_of_turn(family, name, thinking, toks):
    tok, c = toks[family], CONVERSATIONS[name]
    marker, closes, _ = FAMILIES[family]
    if thinking and name == "multi" and family == "deepseek-v3":  # refused with the named reason, never masked
        with pytest.raises(Unmaskable) as refused:
            masked(tok, c, thinking=thinking)
        assert refused.value.reason == "template_drops_reasoning" and "data.thinking=false" in refused.value.detail
        return
    seq = masked(tok, c, thinking=thinking)
    ids, mask = seq.input_ids.tolist(), seq.loss_mask.tolist()
    assert (ids, mask) == reference(tok, c, thinking=thinking, marker=marker, closes=closes)
    replies = [m.content for m in c.messages if m.role == "assistant"]
    supervised = runs(tok, ids, mask)
    assert len(supervised) == len(replies)
    for text, reply in zip(supervised, replies):
        assert text.endswith(marker) and reply.split("</think>")[-1].strip() in text
    for i, message in enumerate(c.messages):  # no token of a serve prompt's own text is supervised
        if message.role == "assistant":
            prompt = render(tok, c.messages[:i], thinking=thinking, add_generation_prompt=True)
            gen = prompt[len(render(tok, c.messages[:i], thinking=thinking)):]
            assert not any(gen.strip() and gen.strip() in text for text in supervised), (gen, supervised)


def test_a_template_error_drops_the_conversation_with_its_reason(toks):
    """Gemma 3's template insists on alternating turns, as the published one does: a conversation that breaks it is
    dropped and counted, never masked."""
    broken = conv(("user", "one"), ("user", "two"), ("assistant", "An answer long enough to keep."))
    with pytest.raises(Unmaskable, match="template_error"):
        masked(toks["gemma3"], broken, thinking=False)
    outcome = tokenize_all([broken, SINGLE], toks["gemma3"], thinking=False, max_length=256, min_supervised=1)
    assert outcome.dropped == {"template_error": 1} and len(outcome.dataset) == 1


GENERATED = {  # (family, thinking): what the target writes after the generation prompt, before its end of turn
    ("gemma3", False): "Four, I think.",
    ("gemma4", False): "Four, I think.",
    ("gemma4", True): "<|channel>thought\nAdd them.<channel|>Four, I think.",
    ("llama4", False): "Four, I think.",
    ("deepseek-v3", False): "Four, I think.",
    ("deepseek-v3", True): "Add them.</think>Four, I think.",
    ("glm4-moe", False): "\nFour, I think.",
    ("glm4-moe", True): "\n<think>Add them.</think>\nFour, I think.",
    ("minimax-m2", False): "Add them.\n</think>\n\nFour, I think.",
    ("nemotron-h", False): "Four, I think.",
    ("nemotron-h", True): "Add them.\n</think>\nFour, I think.",
    ("qwen3.5", False): "Four, I think.",
    ("qwen3.5", True): "Add them.\n</think>\n\nFour, I think.",
    ("kimi-k2", False): "Four, I think.",
}


@pytest.fixture(scope="module")
def scripted_target():
    """The tiny Qwen3 target (its embedding covers every tiny tokenizer) whose head writes a script: `script` holds
    the ids it emits, one a forward, whatever it is given."""
    from dflash_trainer.target.config import TargetConfig
    from dflash_trainer.target.load import load_target

    model = load_target(TargetConfig(random_init="tiny", dtype="float32", compile=False), "cpu", seed=0)
    script: list[int] = []

    def write(module, inputs, logits):  # (B, T, V): the next scripted id wins everywhere
        forced = torch.full_like(logits, -1e4)
        forced[..., script.pop(0)] = 0.0
        return forced

    model.lm_head.register_forward_hook(write)
    return SimpleNamespace(model=model, script=script)


@pytest.mark.parametrize("family,thinking", GENERATED, ids=[f"{f}-{'on' if t else 'off'}" for f, t in GENERATED])
def test_a_regenerated_reply_is_supervised_as_the_target_wrote_it(family, thinking, toks, scripted_target):
    """`regenerate` asks with the family's generation prompt and stops at its end of turn; the stored reply (with the
    think block the prompt opened, if any), trained on, supervises the very tokens the target wrote, the end of turn
    included, or is refused with the reason where the template drops its reasoning."""
    from dflash_trainer.regen.local import LocalBackend

    tok = toks[family]
    marker = FAMILIES[family][0]
    written = tok(GENERATED[family, thinking], add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(marker)]
    scripted_target.script[:] = written + tok("never read", add_special_tokens=False)["input_ids"]
    backend = LocalBackend(model=scripted_target.model, tokenizer=tok, max_new_tokens=64, temperature=0.0,
                           thinking=thinking, batch_size=1)
    question = (Message(role="system", content="Be brief."), Message(role="user", content="What is two plus two?"))
    (reply,) = backend.reply([("r0", question)])
    assert isinstance(reply, str) and reply.endswith("Four, I think.")
    answered = Conversation(messages=(*question, Message(role="assistant", content=reply)), source="t", source_index=0)
    if thinking and family in DROPS_REASONING:
        with pytest.raises(Unmaskable, match="template_drops_reasoning"):
            masked(tok, answered, thinking=thinking)
        return
    seq = masked(tok, answered, thinking=thinking)
    assert seq.input_ids[seq.loss_mask].tolist() == written
    prompt = render(tok, question, thinking=thinking, add_generation_prompt=True)
    context = seq.input_ids[: int(seq.loss_mask.nonzero()[0])].tolist()
    assert (context == tok(prompt, add_special_tokens=False)["input_ids"]) is ((family, thinking) not in PROMPT_NOT_RENDERED)


HARMONY = (  # shaped like gpt-oss's: every message closed by <|end|>, but a final reply by <|return|>, which ends
    # generation (<|end|> also closes the reasoning channel the target writes before its answer: not a stop token)
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] -}}"
    "{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def test_a_final_reply_ends_with_its_own_token_where_the_template_gives_it_one():
    """gpt-oss's template closes earlier replies with `<|end|>` and the final one with `<|return|>` (what the target
    writes last): each reply is supervised through its own, never across the next user turn, and decoding stops at
    `<|return|>`, not at the `<|end|>` that closes the target's reasoning channel."""
    import copy

    tok = copy.deepcopy(build_tiny_tokenizer("qwen3"))
    tok.add_tokens(["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"], special_tokens=True)
    tok.chat_template = HARMONY
    ends = turn_ends(tok, thinking=False)
    assert ends == TurnEnds(inner="<|end|>", final="<|return|>")
    seq = masked(tok, PLAIN, thinking=False)
    ids, mask = seq.input_ids.tolist(), seq.loss_mask.tolist()
    assert runs(tok, ids, mask) == ["<|channel|>final<|message|>Hi! How can I help?<|end|>",
                                    "<|channel|>final<|message|>Why did the chicken cross the road?<|return|>"]
    target = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    stops = set(tok.convert_ids_to_tokens(stop_token_ids(tok, target)))
    assert "<|return|>" in stops and "<|end|>" not in stops


def test_a_worker_process_ends_the_final_reply_as_this_one_does(toks):
    """The settings a tokenizer worker gets carry the template's turn ends: GLM-4.5's final replies get their
    appended `<|user|>` there too."""
    from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_in_workers, tokenize_one

    tok = toks["glm4-moe"]
    settings = TokenizeSettings(thinking=False, end_of_turn=turn_ends(tok, thinking=False), max_length=256,
                                min_supervised=1)
    chats = [PLAIN, SINGLE, MULTI]
    out = tokenize_in_workers(chats, tok, settings, num_workers=1)
    here = [tokenize_one(c, tok, settings) for c in chats]
    assert [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in out] == \
        [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in here]
    assert all(r.input_ids[-1] == tok.convert_tokens_to_ids("<|user|>") and r.loss_mask[-1] for r in out)
