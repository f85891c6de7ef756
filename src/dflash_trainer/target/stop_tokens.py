"""The tokens that end a reply of the target: decoding (evaluation, regeneration) stops at them."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_trainer.data.masks import turn_ends
from dflash_trainer.errors import ConfigError

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>")
"""End-of-turn tokens of the common chat template families; those the tokenizer knows stop generation."""


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Token ids that end a reply: the token the chat template ends a conversation's final reply with (the loss masks
    end that reply with it: a family's own, e.g. Gemma's `<end_of_turn>`, gpt-oss's `<|return|>`, or GLM-4.5's
    next-turn `<|user|>`), the tokenizer's eos, the model's eos ids, known end-of-turn tokens."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    for thinking in (False, True):
        try:
            ids.add(vocab[turn_ends(tokenizer, thinking=thinking).final])
        except ConfigError:  # a template with no end-of-turn token: training refuses it; decoding stops at eos
            pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    model_eos = model.generation_config.eos_token_id
    if model_eos is not None:
        ids.update([model_eos] if isinstance(model_eos, int) else model_eos)
    if not ids:
        raise ValueError("the tokenizer has no eos token and no known end-of-turn token; set one in its config")
    return sorted(ids)
