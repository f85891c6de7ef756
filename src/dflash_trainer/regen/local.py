"""Local backend: batched decoding of the target on this machine (`eval/batched.py`).

Conversations are taken in chunks; each chunk is answered round by round (round k answers every
conversation's k-th user turn, conditioned on its regenerated earlier turns). Within a round the prompts
are sorted by length and generated in left-padded batches of `batch_size` with a KV cache; finished rows
leave the batch as they end. Greedy at temperature 0, else sampled at `temperature` from the `top_p` nucleus
(no top-k). A chunk's rows are yielded when its last round is done, so an interruption loses at
most one chunk. `reply` (one turn of many conversations) and `continue_ids` (raw continuations, with whether
each ended at a stop token) serve `synthesize` as well.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Iterator, Optional, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_trainer.data.masks import render
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.data.vision import ImageTokens
from dflash_trainer.errors import DataError
from dflash_trainer.eval.batched import decode_batch
from dflash_trainer.eval.image_prompts import PromptImages, encode_image_prompt
from dflash_trainer.target.load import text_config
from dflash_trainer.target.stop_tokens import stop_token_ids

from dflash_trainer.regen.batch_memory import cut_batches, decode_budget
from dflash_trainer.regen.turns import Continuation, RegenOutcome, TurnState, as_dicts, skipped, start

_OPEN_THINK = re.compile(r"<think>\s*$")

log = logging.getLogger(__name__)

CHUNK_BATCHES = 4
"""Conversations per chunk = CHUNK_BATCHES * batch_size (more: better length sorting, more lost on a crash)."""
class LocalBackend:
    """Answers conversations with `model.generate`; greedy when temperature == 0, else sampling."""

    def __init__(
        self,
        *,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        temperature: float,
        thinking: bool,
        batch_size: int,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        top_p: float = 1.0,
        extra_stop_ids: Sequence[int] = (),
        images: Optional[ImageTokens] = None,
    ) -> None:
        self.model = model
        self.images = images
        """The image-text target's image processing: prompts with images are answered with them (None: a text
        target, which is never given image conversations)."""
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer
        self.thinking = thinking
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.stop_ids = sorted(set(stop_token_ids(tokenizer, model)) | set(extra_stop_ids))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.max_positions = getattr(text_config(model.config), "max_position_embeddings", None)
        self.seed = seed
        self.temperature = temperature
        self.top_p = top_p
        rows = model.get_input_embeddings().num_embeddings
        self.banned = list(range(len(tokenizer), rows))  # spare embedding rows decode to nothing: never generate
        self.generator = torch.Generator(device=model.device)

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream (a caller that asks in chunks seeds each chunk)."""
        self.generator.manual_seed(seed)

    def run(self, conversations: Iterable[Conversation]) -> Iterator[RegenOutcome]:
        self.reseed(self.seed)
        chunk: list[TurnState] = []
        for conv in conversations:
            state = start(conv)
            if isinstance(state, RegenOutcome):
                yield state
                continue
            chunk.append(state)
            if len(chunk) >= CHUNK_BATCHES * self.batch_size:
                yield from self._run_chunk(chunk)
                chunk = []
        if chunk:
            yield from self._run_chunk(chunk)

    def _run_chunk(self, states: list[TurnState]) -> Iterator[RegenOutcome]:
        ended: dict[str, RegenOutcome] = {}  # skipped at the first turn, or cut short at a later one
        active = states
        while active:
            replies = self.reply([(state.row_id, state.next_prompt()) for state in active])  # type: ignore[misc]
            for state, reply in zip(active, replies):
                if isinstance(reply, RegenOutcome):
                    ended[state.row_id] = state.outcome(cut=reply.skipped) if state.replied else reply
                else:
                    state.add_reply(reply)
            active = [s for s in active if s.row_id not in ended and s.next_prompt() is not None]
        for state in states:
            yield ended.get(state.row_id) or state.outcome()

    def reply(self, prompts: Sequence[tuple[str, tuple[Message, ...]]]) -> list[str | RegenOutcome]:
        """The target's reply to each (row id, messages ending with a user turn), in order; a prompt over a
        length limit gets its row's skip instead."""
        replies: list[str | RegenOutcome] = []
        asked: list[tuple[int, list[int], str, Optional[PromptImages]]] = []  # (index, prompt ids, prefix, images)
        for i, (rid, messages) in enumerate(prompts):
            encoded = self._encode(rid, messages)
            replies.append(encoded if isinstance(encoded, RegenOutcome) else "")
            if not isinstance(encoded, RegenOutcome):
                asked.append((i, *encoded))
        continuations = self.continue_ids([a[1] for a in asked], images=[a[3] for a in asked])
        for (i, _, prefix, _), continuation in zip(asked, continuations):
            replies[i] = prefix + continuation.text
        return replies

    def _encode(self, rid: str,
                messages: tuple[Message, ...]) -> tuple[list[int], str, Optional[PromptImages]] | RegenOutcome:
        """(prompt ids, reply prefix, the prompt's images), or the row's skip when the prompt is over a length limit.

        The prefix is an opening think block that the template put in the generation prompt (some thinking
        templates do): the stored reply starts with it, so training renders the same text. A prompt with images
        is encoded as training encodes it (`image_prompts.py`: its image tokens, the processor's patches).
        """
        if any(m.images for m in messages):
            if self.images is None:
                raise DataError(f"row {rid} has images and the target has no image processor: regenerate image "
                                "conversations with an image-text target")
            text = render(self.tokenizer, messages, thinking=self.thinking, add_generation_prompt=True)
            tokens, images = encode_image_prompt(self.tokenizer, messages, self.images, thinking=self.thinking,
                                                 max_prompt_tokens=1 << 62)
            ids = self.check_length(rid, tokens.tolist())
        else:
            text = self.tokenizer.apply_chat_template(
                as_dicts(messages), tokenize=False, add_generation_prompt=True, enable_thinking=self.thinking
            )
            ids, images = self.encode_text(rid, text), None
        if isinstance(ids, RegenOutcome):
            return ids
        match = _OPEN_THINK.search(text)
        return ids, (match.group(0) if match else ""), images

    def encode_text(self, rid: str, text: str) -> list[int] | RegenOutcome:
        """The ids of a rendered prompt, or the row's skip when it is over a length limit."""
        return self.check_length(rid, self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_length(self, rid: str, ids: list[int]) -> list[int] | RegenOutcome:
        """`ids`, or the row's skip when they are over a length limit."""
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return skipped(rid, f"prompt over regenerate.max_prompt_tokens={self.max_prompt_tokens}",
                           f"{len(ids)} tokens")
        if self.max_positions is not None and len(ids) + self.max_new_tokens > self.max_positions:
            return skipped(rid, f"prompt + max_new_tokens over the target's {self.max_positions} positions",
                           f"{len(ids)} + {self.max_new_tokens} tokens")
        return ids

    def continue_ids(self, prompts: Sequence[list[int]],
                     images: Optional[Sequence[Optional[PromptImages]]] = None) -> list[Continuation]:
        """What the target writes after each prompt (token ids; `images`: each one's images, None for text), in
        order; decoded in length-sorted batches of `batch_size` (left padding wastes least when lengths are close),
        fewer rows where a batch would not fit the memory free (`batch_memory.py`)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        images = images or [None] * len(prompts)
        found: dict[int, Continuation] = {}
        for batch in cut_batches([len(p) for p in prompts], order, batch_size=self.batch_size,
                                 new_tokens=self.max_new_tokens, budget=decode_budget(self.model)):
            found.update(zip(batch, self._generate([prompts[i] for i in batch], [images[i] for i in batch])))
        return [found[i] for i in range(len(prompts))]

    def _generate(self, prompts: list[list[int]], images: list[Optional[PromptImages]]) -> list[Continuation]:
        """Continuations of `prompts` (token ids) with their images, cut before the first stop token, decoded
        verbatim."""
        results = decode_batch(
            self.model, [torch.tensor(p, dtype=torch.int64) for p in prompts], max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_ids, temperature=self.temperature, top_p=self.top_p, generator=self.generator,
            pad_token_id=self.pad_id, banned_token_ids=self.banned,
            images=images if any(i is not None for i in images) else None,
        )
        stops = set(self.stop_ids)
        found = []
        for result in results:
            tokens = result.output_ids
            end = next((i for i, t in enumerate(tokens) if t in stops), None)
            text = self.tokenizer.decode(tokens[: len(tokens) if end is None else end], skip_special_tokens=False)
            found.append(Continuation(text=text, finished=end is not None))
        return found
