"""Batched decoding: many prompts at once, each row committing its own number of tokens per step.

One loop serves plain decoding (no proposer: one token per step), speculative decoding with a DFlash
drafter, and the prompt-lookup baseline (`proposers.py`); regeneration uses it for plain decoding too.

Cache layout, shared by the target and the proposers: every target forward appends the same number of
cache slots to every row (the prompt, left-padded, then one block per step). A slot that does not hold a
committed token (prompt padding, a rejected draft) stays in the cache with `valid` False and is masked out
of every later attention; positions are per row, so a row's committed tokens keep consecutive positions
whatever its neighbours accept. Rows that finish are dropped from the batch in groups (`_compact`).

Accounting, as in the single-sequence loop (`speculative.py`, checked against the reference package): a
verification step feeds `[last committed token, d_1 .. d_n]`, accepts the longest agreeing prefix of drafts
plus the target's own next token (the bonus); its acceptance length = accepted + 1, cut by a stop token or
`max_new_tokens`. Near `max_new_tokens` a row's block shrinks to what can still be committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
from transformers import DynamicCache

from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.image_prompts import (ImagePrefill, PromptImages, deepstack_tap_inputs, image_prefill,
                                              mrope_position_ids, prefill_position_ids)
from dflash_trainer.eval.linear_states import keep_committed_states, linear_layers, record_linear_states, select_rows
from dflash_trainer.eval.speculative import DecodeResult, _forward, decoding_kernels
from dflash_trainer.target.load import text_config


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextUpdate:
    """The cache slots one target forward appended to every row (the prompt, or a verified block)."""

    tokens: torch.Tensor
    """(R, n) int64: token fed at each slot."""
    positions: torch.Tensor
    """(R, n) int64: absolute position of each slot."""
    valid: torch.Tensor
    """(R, n) bool: the slot holds a committed token."""
    taps: Optional[torch.Tensor]
    """(R, n, K*H) target taps at each slot (tap l = output of decoder layer l), or None when the proposer
    needs none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockDrafts:
    """Drafts for one verification step of every row."""

    tokens: torch.Tensor
    """(R, B-1) int64: drafts for positions start+1 .. start+B-1 (entries past `lengths` are ignored)."""
    lengths: torch.Tensor
    """(R,) int64: drafts proposed per row, 0 .. B-1."""
    probs: Optional[torch.Tensor] = None
    """(R, B-1, V) fp32 distributions the drafts were sampled from (temperature > 0); None: each draft is a
    fixed choice (a point mass)."""


class BatchProposer(Protocol):
    """Drafts blocks for a batch of rows; told every committed context slot, in order."""

    needs_taps: bool

    def observe(self, update: ContextUpdate) -> None:
        """Slots appended to every row: the prompt first, then each verified block."""

    def propose(self, last_tokens: torch.Tensor, starts: torch.Tensor, max_lengths: torch.Tensor, block_size: int,
                temperature: float, generator: Optional[torch.Generator]) -> BlockDrafts:
        """Drafts after `last_tokens` (R,) at positions `starts` (R,); at most `max_lengths` (R,) each."""

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (R',) int64 (the others finished), in that order."""


def _left_pad(prompts: Sequence[torch.Tensor], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (R, P), valid (R, P) bool, positions (R, P) int64) of left-padded prompts."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[0]:] = p
        valid[row, width - p.shape[0]:] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), valid.to(device), positions.to(device)


def _taps(hidden_states: Sequence[torch.Tensor], tap_layer_ids: Sequence[int],
          read_after_add: Optional[dict[int, torch.Tensor]] = None) -> torch.Tensor:
    """(R, n, K*H): tap l = output of decoder layer l = hidden_states[l + 1], or, where the forward added visual
    features after layer l, the next layer's input (`read_after_add`, tap id -> (R, n, H))."""
    read_after_add = read_after_add or {}
    return torch.cat([read_after_add.get(l, hidden_states[l + 1]) for l in tap_layer_ids], dim=-1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (..., V) restricted to the smallest set of most likely tokens whose mass reaches `top_p`,
    renormalised (the top token always stays)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)  # (..., V)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (..., V) mass of the more likely tokens
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def _pick(logits: torch.Tensor, temperature: float, generator, banned: Optional[torch.Tensor],
          top_p: float = 1.0) -> torch.Tensor:
    """Tokens (...,) from logits (..., V): argmax, or sampled at `temperature` from the `top_p` nucleus."""
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if temperature <= 0:
        return logits.argmax(-1)
    probs = nucleus(torch.softmax(logits.float() / temperature, dim=-1), top_p)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1])


def accept_greedy(logits: torch.Tensor, drafts: BlockDrafts) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted (R,), bonus (R,)): the longest prefix of drafts equal to the target's argmax, and the
    target's token after it. logits (R, B, V) of the fed block."""
    target_tokens = logits.argmax(-1)  # (R, B)
    slots = torch.arange(drafts.tokens.shape[1], device=logits.device)
    agree = (drafts.tokens == target_tokens[:, :-1]) & (slots < drafts.lengths[:, None])  # (R, B-1)
    accepted = agree.long().cumprod(1).sum(1)  # (R,)
    return accepted, target_tokens.gather(1, accepted[:, None])[:, 0]


def accept_sampled(logits: torch.Tensor, drafts: BlockDrafts, temperature: float,
                   generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling per row: accept draft d with probability min(1, p(d)/q(d)); at the first
    rejection sample the bonus from normalise(max(p - q, 0)), after all drafts from p. The committed tokens
    then follow the target's sampling distribution. q is a point mass when `drafts.probs` is None."""
    rows, b, vocab = logits.shape
    p = torch.softmax(logits.float() / temperature, dim=-1)  # (R, B, V)
    d = drafts.tokens  # (R, B-1)
    p_d = p[:, :-1].gather(2, d[..., None])[..., 0]  # (R, B-1)
    q_d = torch.ones_like(p_d) if drafts.probs is None else drafts.probs.gather(2, d[..., None])[..., 0]
    u = torch.rand(p_d.shape, generator=generator, device=p.device)
    slots = torch.arange(b - 1, device=p.device)
    ok = (u < (p_d / q_d.clamp_min(1e-20)).clamp(max=1.0)) & (slots < drafts.lengths[:, None])
    accepted = ok.long().cumprod(1).sum(1)  # (R,)
    p_at = p.gather(1, accepted[:, None, None].expand(rows, 1, vocab))[:, 0]  # (R, V)
    at = accepted.clamp(max=b - 2)[:, None]  # the rejected draft's slot (clamped where none was rejected)
    if drafts.probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, d.gather(1, at), 1.0)
    else:
        q_at = drafts.probs.gather(1, at[..., None].expand(rows, 1, vocab))[:, 0]
    residual = (p_at - q_at).clamp_min(0)  # (R, V)
    total = residual.sum(-1, keepdim=True)
    rejected = (accepted < drafts.lengths)[:, None] & (total > 0)
    dist = torch.where(rejected, residual / total.clamp_min(1e-30), p_at)
    return accepted, torch.multinomial(dist, 1, generator=generator)[:, 0]


MASKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""The layer types `position_masks` serves; other kinds (linear attention, convolutions) keep HF's own masks."""


def _position_layer_types(config) -> Optional[set]:
    """The layer kinds of a config whose kinds are all `MASKED_LAYER_TYPES`; None when it has others (or none)."""
    layer_types = getattr(text_config(config), "layer_types", None)
    kinds = set(layer_types) if layer_types is not None else None
    return kinds if kinds is not None and kinds <= set(MASKED_LAYER_TYPES) else None


def sliding_window_of(config) -> Optional[int]:
    """The attention window of a target with sliding-window layers (gpt-oss, Gemma 3; Mistral-style configs), else
    None (also when some layers are of a kind other than `MASKED_LAYER_TYPES`). An image-text-to-text config:
    its language model's."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None) is not None:
        kinds = _position_layer_types(config)
        return window if kinds is not None and "sliding_attention" in kinds else None
    return window if getattr(config, "use_sliding_window", True) else None


def attention_chunk_of(config) -> Optional[int]:
    """The chunk of a target with chunked-attention layers (Llama 4: a query sees the keys of its own chunk of
    `attention_chunk_size` positions), else None (also beside kinds other than `MASKED_LAYER_TYPES`)."""
    kinds = _position_layer_types(config)
    return getattr(text_config(config), "attention_chunk_size", None) if kinds and "chunked_attention" in kinds else None


def position_masks(key_valid: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor, *,
                   window: Optional[int], chunk: Optional[int] = None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Additive attention masks (R, 1, n, S) by position, per layer type: a query sees every valid key at or before
    its position (`full_attention`); in a sliding layer only those less than `window` positions back (as HF's
    window), in a chunked one only those of its own chunk of `chunk` positions (as HF's chunks, which start at each
    row's first token: position 0 here). key_valid (R, S) bool, key_positions (R, S), query_positions (R, n)."""
    queries, keys = query_positions[:, :, None].int(), key_positions[:, None, :].int()  # (R, n, 1), (R, 1, S)
    back = queries - keys  # (R, n, S)
    seen = key_valid[:, None, :] & (back >= 0)  # (R, n, S)
    blocked = torch.finfo(dtype).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, blocked)[:, None]

    masks = {"full_attention": additive(seen)}
    if window:
        masks["sliding_attention"] = additive(seen & (back < window))
    if chunk:
        masks["chunked_attention"] = additive(seen & (queries // chunk == keys // chunk))
    return masks


class _TargetCache:
    """The target's KV cache of a batch, and each slot's position and whether it is valid.

    Slots that hold no committed token (prompt padding, rejected drafts) stay, masked out. HF's masks and its
    sliding-window caches count slots, so with drafts a sliding window (or Llama 4's attention chunks) would count
    rejected drafts too and drop committed tokens: a target with sliding-window or chunked layers then keeps every
    slot (a plain cache) and, after the prefill, gets masks built here from the positions (`position_masks`: (R, n,
    S) for a block of n, where the prefill's would be (R, P, P)). Plain decoding leaves no hole between committed slots,
    so it keeps HF's masks and windowed caches. A hybrid target's recurrent layers have no slots to mask: with
    drafts they record their state after each fed token and keep each row's committed one (`linear_states.py`).
    `block_width`: the tokens fed per step with drafts (None: plain decoding)."""

    def __init__(self, target, *, block_width: Optional[int]) -> None:
        speculative = block_width is not None
        self.target, self.block_width = target, block_width
        self.window = sliding_window_of(target.config) if speculative else None
        self.chunk = attention_chunk_of(target.config) if speculative else None
        self.by_position = bool(self.window or self.chunk)
        self.by_layer_type = getattr(text_config(target.config), "layer_types", None) is not None
        self.cache = DynamicCache() if self.by_position else DynamicCache(config=target.config)
        self.valid: Optional[torch.Tensor] = None  # (R, S) bool
        self.positions: Optional[torch.Tensor] = None  # (R, S) int64, kept for the position masks only
        self.rope_deltas: Optional[torch.Tensor] = None
        """(R,) int64 after a prefill with images: each row's M-RoPE offset of the text after its prompt
        (`image_prompts.py`); None for a text batch, whose M-RoPE positions are its slot positions."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, new_valid: torch.Tensor, *, hidden: bool,
                last_only: bool = False, images: Optional[ImagePrefill] = None):
        """Feed ids (R, n) at positions (R, n); new_valid (R, n) marks real tokens among them (padding is
        False); `images`: the prefill's images (`image_prompts.image_prefill`). Returns the HF output (logits
        (R, n or 1, V), hidden states if asked)."""
        mask = new_valid if self.valid is None else torch.cat([self.valid, torch.ones_like(new_valid)], 1)
        attention_mask = mask.long()
        if self.by_position:
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], 1)
        if self.by_position and self.valid is not None:  # the prefill has no holes yet: HF's masks are right, and small
            masks = position_masks(mask, self.positions, positions, window=self.window, chunk=self.chunk,
                                   dtype=self.target.dtype)
            attention_mask = masks if self.by_layer_type else masks["sliding_attention"]
        kwargs = {"logits_to_keep": 1} if last_only else {}
        position_ids = positions
        if images is not None:  # the image-text model's forward: vision tower, its positions and masks
            self.rope_deltas = images.rope_deltas
            position_ids = prefill_position_ids(positions, images)  # (4, R, n) with M-RoPE, else (R, n)
            kwargs |= images.kwargs
        elif self.rope_deltas is not None:
            position_ids = mrope_position_ids(positions, self.rope_deltas)  # (4, R, n)
        out = _forward(self.target, ids, self.cache, attention_mask=attention_mask, position_ids=position_ids,
                       output_hidden_states=hidden, **kwargs)
        if self.valid is None and self.block_width is not None:  # the prefill: recurrent layers start recording
            record_linear_states(self.cache, self.block_width)
        self.valid = new_valid if self.valid is None else torch.cat([self.valid, new_valid], 1)
        return out

    def commit(self, valid_tail: torch.Tensor) -> None:
        """Mark which of the last n slots hold committed tokens: valid_tail (R, n) bool."""
        n = valid_tail.shape[1]
        self.valid = torch.cat([self.valid[:, :-n], valid_tail], 1)
        if linear_layers(self.cache):  # committed slots are a prefix of the block
            keep_committed_states(self.cache, valid_tail.sum(1), fed=n)

    def keep(self, rows: torch.Tensor) -> None:
        select_rows(self.cache, rows)
        self.valid = self.valid[rows]
        if self.positions is not None:
            self.positions = self.positions[rows]
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas[rows]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeSettings:
    """How `decode_batch` decodes (the same for every row)."""

    max_new_tokens: int
    stop_token_ids: frozenset[int]
    width: int
    """Tokens fed per row and step: the block size (speculative), or 1."""
    temperature: float
    top_p: float
    """Plain decoding samples from this nucleus (1.0: the whole distribution)."""
    generator: Optional[torch.Generator]
    banned: Optional[torch.Tensor]
    """(n,) int64 token ids plain decoding never picks, or None."""
    tap_layer_ids: tuple[int, ...]


def _check_finite(logits: torch.Tensor) -> None:
    """A ConfigError unless every row of the prefill's next-token logits (R, V) is finite: a target whose numerics
    break decodes garbage (its argmax of NaN) without a word."""
    broken = (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()  # host sync, once per decode
    if broken:
        raise ConfigError(
            f"the target's next-token logits are NaN or inf after {len(broken)} of {logits.shape[0]} prompts (the "
            f"first: prompt {broken[0]} of the batch): its numerics are broken, and its replies would be garbage. "
            "Check target.dtype (float16 can overflow: use bfloat16) and target.quantize"
        )


class _BatchDecode:
    """The decoding state of one batch: device tensors per batch row, host lists per prompt. Rows whose prompt
    is done stay in the batch (ignored) until a quarter of the batch is done, then leave it together."""

    def __init__(self, target, prompts: Sequence[torch.Tensor], proposer: Optional[BatchProposer],
                 settings: DecodeSettings, pad_token_id: int, on_step: Callable[[int], None],
                 images: Sequence[Optional[PromptImages]] = ()) -> None:
        self.device = next(target.parameters()).device
        self.proposer, self.settings, self.on_step = proposer, settings, on_step
        self.hidden = proposer is not None and proposer.needs_taps
        self.cache = _TargetCache(target, block_width=settings.width if proposer is not None else None)
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.lengths: list[list[int]] = [[] for _ in prompts]
        self.reasons = ["max_new_tokens"] * len(prompts)
        self.active = list(range(len(prompts)))  # batch row -> prompt index
        self.finished: list[int] = []  # batch rows whose prompt is done (dropped at the next compaction)
        self.slot = torch.arange(settings.width, device=self.device)
        ids, valid, positions = _left_pad(prompts, pad_token_id, self.device)
        prefill = image_prefill(target, ids, valid, images)
        with deepstack_tap_inputs(target, settings.tap_layer_ids, self.hidden and prefill is not None) as after_add:
            out = self.cache.forward(ids, positions, valid, hidden=self.hidden, last_only=True, images=prefill)
        _check_finite(out.logits[:, -1])
        self._observe(ids, positions, valid, out, after_add)
        self.last = _pick(out.logits[:, -1], settings.temperature, settings.generator, settings.banned,
                          settings.top_p)  # (R,)
        self.starts = valid.sum(1)  # (R,) position of each row's last committed token (not yet fed)
        for row, token in enumerate(self.last.tolist()):  # host sync: the loop needs the first tokens
            self.outputs[row].append(token)
            if token in settings.stop_token_ids or settings.max_new_tokens <= 1:
                self.reasons[row] = "eos" if token in settings.stop_token_ids else "max_new_tokens"
                self.finished.append(row)
        on_step(len(prompts))

    def running(self) -> bool:
        return len(self.finished) < len(self.active)

    def _observe(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, out,
                 read_after_add: Optional[dict[int, torch.Tensor]] = None) -> None:
        if self.proposer is not None:
            taps = _taps(out.hidden_states, self.settings.tap_layer_ids, read_after_add) if self.hidden else None
            self.proposer.observe(ContextUpdate(tokens=tokens, positions=positions, valid=valid, taps=taps))

    def compact(self) -> None:
        """Drop the finished rows once a quarter of the batch is done (a copy of every cache)."""
        if not self.finished or len(self.finished) * 4 < len(self.active):
            return
        done = set(self.finished)
        keep = [r for r in range(len(self.active)) if r not in done]
        rows = torch.tensor(keep, dtype=torch.int64, device=self.device)
        self.cache.keep(rows)
        self.last, self.starts = self.last[rows], self.starts[rows]
        if self.proposer is not None:
            self.proposer.keep(rows)
        self.active = [self.active[r] for r in keep]
        self.finished = []

    def step(self) -> None:
        """One target forward for every row: verify its drafts (or decode one token), commit, move on."""
        s = self.settings
        block_positions = self.starts[:, None] + self.slot  # (R, W)
        if self.proposer is not None:
            remaining = torch.tensor([s.max_new_tokens - len(self.outputs[p]) for p in self.active], device=self.device)
            drafts = self.proposer.propose(self.last, self.starts, remaining.clamp(max=s.width - 1), s.width,
                                           s.temperature, s.generator)
            block = torch.cat([self.last[:, None], drafts.tokens], 1)  # (R, W)
        else:
            block = self.last[:, None]
        out = self.cache.forward(block, block_positions, torch.ones_like(block, dtype=torch.bool), hidden=self.hidden)
        if self.proposer is None:
            accepted = torch.zeros_like(self.last)
            bonus = _pick(out.logits[:, 0], s.temperature, s.generator, s.banned, s.top_p)
        elif s.temperature <= 0:
            accepted, bonus = accept_greedy(out.logits, drafts)
        else:
            accepted, bonus = accept_sampled(out.logits, drafts, s.temperature, s.generator)
        if self.proposer is not None:
            committed_slots = self.slot <= accepted[:, None]  # (R, W): the fed tokens that stay
            self.cache.commit(committed_slots)
            self._observe(block, block_positions, committed_slots, out)
        # host sync: one copy of the step's results, the loop decides on the host what each row keeps
        self._commit(torch.cat([block, accepted[:, None], bonus[:, None]], 1).tolist())
        self.last = bonus
        self.starts = self.starts + accepted + 1

    def _commit(self, host: list[list[int]]) -> None:
        """Each unfinished row keeps its accepted drafts and the bonus token, cut at a stop token or the budget."""
        s, width = self.settings, self.settings.width
        done = set(self.finished)
        committed = 0
        for r, row in enumerate(host):
            if r in done:
                continue
            prompt = self.active[r]
            kept = (row[1 : row[width] + 1] + [row[width + 1]])[: s.max_new_tokens - len(self.outputs[prompt])]
            stop_at = next((i for i, t in enumerate(kept) if t in s.stop_token_ids), None)
            if stop_at is not None:
                kept = kept[: stop_at + 1]
                self.reasons[prompt] = "eos"
            self.outputs[prompt].extend(kept)
            committed += len(kept)
            if self.proposer is not None:
                self.lengths[prompt].append(len(kept))
            if self.reasons[prompt] == "eos" or len(self.outputs[prompt]) >= s.max_new_tokens:
                self.finished.append(r)
        self.on_step(committed)


@torch.no_grad()
@decoding_kernels
def decode_batch(
    target,
    prompts: Sequence[torch.Tensor],
    *,
    proposer: Optional[BatchProposer] = None,
    block_size: int = 1,
    tap_layer_ids: Sequence[int] = (),
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    pad_token_id: int = 0,
    banned_token_ids: Sequence[int] = (),
    on_step: Callable[[int], None] = lambda committed: None,
    images: Optional[Sequence[Optional[PromptImages]]] = None,
) -> list[DecodeResult]:
    """Decode every prompt ((L,) int64 each) to a stop token or `max_new_tokens`.

    `images`: each prompt's images (None: a text prompt), for an image-text target (`image_prompts.py`); its
    image tokens are in the prompt's ids.
    Without a proposer this is plain decoding (greedy, or sampled at `temperature`), one token per step and
    no acceptance lengths. With one, each step verifies a block of `block_size` tokens. `banned_token_ids`
    are never generated by plain decoding, and `top_p` < 1 samples it from a nucleus; speculative decoding
    leaves the target's distribution alone (so it refuses `top_p` < 1).
    `on_step(n)` is told the tokens committed by each step (for a progress bar).
    """
    start_time = time.perf_counter()
    device = next(target.parameters()).device
    speculative = proposer is not None and block_size > 1
    if speculative and top_p < 1.0:
        raise ValueError(f"top_p={top_p}: speculative decoding verifies against the full distribution (top_p 1.0)")
    banned = None
    if banned_token_ids and not speculative:
        banned = torch.tensor(list(banned_token_ids), dtype=torch.int64, device=device)
    settings = DecodeSettings(max_new_tokens=max_new_tokens, stop_token_ids=frozenset(stop_token_ids),
                              width=block_size if speculative else 1, temperature=temperature, top_p=top_p,
                              generator=generator,
                              banned=banned, tap_layer_ids=tuple(tap_layer_ids))
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts: give one per prompt (None: none)")
    run = _BatchDecode(target, prompts, proposer if speculative else None, settings, pad_token_id, on_step,
                       images or ())
    while run.running():
        run.compact()
        run.step()
    seconds = time.perf_counter() - start_time
    return [DecodeResult(output_ids=run.outputs[i], acceptance_lengths=run.lengths[i], stop_reason=run.reasons[i],
                         seconds=seconds) for i in range(len(prompts))]
