"""Speculative decoding with a DFlash drafter, and plain target decoding as the reference.

One verification step: the block `[last committed token, d_1 .. d_{B-1}]` (drafts from one drafter
forward) is fed to the target at positions `start .. start+B-1`; the longest prefix of drafts that the
target agrees with is accepted, plus the target's own next token (the bonus). The acceptance length of
the step = accepted drafts + 1. tau = mean acceptance length over ALL verification steps, the last one
included even when `max_new_tokens` or a stop token cut it short; the prefill's first token is not a
verification step and is not counted (as in the DFlash reference loop). Near `max_new_tokens` the block
shrinks to what can still be committed, as the reference loop does.

Caches: the target keeps a DynamicCache cropped to the committed tokens after every step; the drafter
keeps only committed context (block keys are never cached), so it needs no crop.

Greedy (temperature 0) by default; with temperature > 0 drafts are sampled from the drafter and accepted
with the speculative-sampling rule (accept d with prob min(1, p(d)/q(d)); on rejection sample from
normalise(max(p - q, 0))), which leaves the target's sampling distribution unchanged.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from dflash_trainer.drafter.dflash2 import walk
from dflash_trainer.drafter.domino import domino_walk
from dflash_trainer.drafter.dspark import markov_walk
from dflash_trainer.drafter.lilicorr import draft_block
from dflash_trainer.target.capture import SDPA_WITHOUT_CUDNN


@dataclass(frozen=True, slots=True, kw_only=True)
class Draft:
    tokens: torch.Tensor
    """(B-1,) int64: proposed tokens for positions start+1 .. start+B-1."""
    probs: Optional[torch.Tensor] = None
    """(B-1, V) fp32 drafter distributions the tokens were sampled from (temperature > 0), else None."""


class Proposer(Protocol):
    def reset(self) -> None: ...

    def add_context(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Taps (C, K*H) of newly committed tokens at `positions` (C,)."""

    def propose(self, first_token: int, start: int, block_size: int, temperature: float, generator) -> Draft: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeResult:
    output_ids: list[int]
    """Generated tokens (prompt excluded)."""
    acceptance_lengths: list[int]
    """Tokens committed at each verification step (bonus included); empty for plain decoding."""
    stop_reason: str
    """eos | max_new_tokens"""
    seconds: float


def _tap_features(hidden_states: Sequence[torch.Tensor], tap_layer_ids: Sequence[int]) -> torch.Tensor:
    """(T, K*H) taps of one sequence: tap l = output of decoder layer l = hidden_states[l + 1]."""
    return torch.cat([hidden_states[l + 1][0] for l in tap_layer_ids], dim=-1)


def _crop(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions (a negative argument removes tokens in every transformers 5.x)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def decoding_kernels(fn):
    """Run a decoding function with the target eager and without cuDNN attention (`SDPA_WITHOUT_CUDNN`): cuDNN
    builds an execution plan for every new key length, and in decoding every step has a new one (bench/RESULTS.md,
    section 4).

    Eager also when the trainer compiled the target's layers for tap capture (`target.compile`): a compiled
    layer would recompile for every layer's cache state and every new length. The stance is process-wide: this
    relies on evaluation running on the thread that trains (it does, in every role), never beside a compiled
    training step. Both are entered once per decoding call rather than per forward: entering them is not free."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"), sdpa_kernel(list(SDPA_WITHOUT_CUDNN)):
            return fn(*args, **kwargs)

    return wrapper


def _forward(target, input_ids: torch.Tensor, cache: DynamicCache, **kwargs):
    """Target forward with a KV cache (the keyword is `cache` in newer transformers, `past_key_values` before)."""
    key = "cache" if _takes_cache_kwarg(type(target)) else "past_key_values"
    return target(input_ids, use_cache=True, **{key: cache}, **kwargs)


_CACHE_KWARG: dict[type, bool] = {}


def _takes_cache_kwarg(cls: type) -> bool:
    if cls not in _CACHE_KWARG:
        import inspect

        _CACHE_KWARG[cls] = "cache" in inspect.signature(cls.forward).parameters
    return _CACHE_KWARG[cls]


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _truncate(tokens: list[int], budget: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut `tokens` at the first stop token (kept) and at `budget` tokens; True when a stop token ended it."""
    for i, t in enumerate(tokens[:budget]):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens[:budget], False


@torch.no_grad()
@decoding_kernels
def target_generate(
    target, prompt_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids: Sequence[int],
    temperature: float = 0.0, generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    """Plain autoregressive decoding with a KV cache (the reference output and the baseline speed)."""
    start_time = time.perf_counter()
    stop = set(stop_token_ids)
    cache = DynamicCache(config=target.config)
    out = _forward(target, prompt_ids[None], cache, logits_to_keep=1)
    tokens: list[int] = []
    reason = "max_new_tokens"
    while True:
        token = int(_pick(out.logits[0, -1], temperature, generator))  # host sync: the loop needs the token
        tokens.append(token)
        if token in stop:
            reason = "eos"
            break
        if len(tokens) >= max_new_tokens:
            break
        out = _forward(target, torch.tensor([[token]], device=prompt_ids.device), cache)
    return DecodeResult(output_ids=tokens, acceptance_lengths=[], stop_reason=reason, seconds=time.perf_counter() - start_time)


@torch.no_grad()
@decoding_kernels
def speculative_generate(
    target, proposer: Proposer, prompt_ids: torch.Tensor, *, block_size: int, tap_layer_ids: Sequence[int],
    max_new_tokens: int, stop_token_ids: Sequence[int], temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> DecodeResult:
    start_time = time.perf_counter()
    device = prompt_ids.device
    stop = set(stop_token_ids)
    n = prompt_ids.shape[0]
    cache = DynamicCache(config=target.config)
    proposer.reset()
    # logits of the last prompt position only: all T rows would be T x V (GBs for long prompts), and one
    # row is also what plain decoding and the reference loop compute (same bits, same first token)
    out = _forward(target, prompt_ids[None], cache, output_hidden_states=True, logits_to_keep=1)
    proposer.add_context(_tap_features(out.hidden_states, tap_layer_ids), torch.arange(n, device=device))
    first = int(_pick(out.logits[0, -1], temperature, generator))  # host sync: the loop needs the token
    generated = [first]
    lengths: list[int] = []
    if first in stop or max_new_tokens <= 1:
        return DecodeResult(output_ids=generated, acceptance_lengths=[], stop_reason="eos" if first in stop else "max_new_tokens",
                            seconds=time.perf_counter() - start_time)
    start = n  # position of the last committed token, not yet fed to the target
    while True:
        # Near the end the block shrinks to what can still be committed (as the reference loop does).
        size = min(block_size, max_new_tokens - len(generated) + 1)
        if size > 1:
            draft = proposer.propose(generated[-1], start, size, temperature, generator)
        else:
            draft = Draft(tokens=torch.zeros(0, dtype=torch.int64, device=device))
        block = torch.cat([torch.tensor([generated[-1]], device=device), draft.tokens.to(device)])  # (size,)
        positions = torch.arange(start, start + size, device=device)
        out = _forward(target, block[None], cache, position_ids=positions[None], output_hidden_states=True)
        logits = out.logits[0]  # (B, V)
        if temperature <= 0:
            target_tokens = logits.argmax(-1)  # (B,)
            agree = (draft.tokens.to(device) == target_tokens[:-1]).int()
            accepted = int(agree.cumprod(0).sum())  # host sync: the step's acceptance decides the next block
            bonus = int(target_tokens[accepted])
        else:
            accepted, bonus = _accept_sampled(logits, draft, temperature, generator)
        committed = block[1 : accepted + 1].tolist() + [bonus]
        remaining = max_new_tokens - len(generated)
        kept, hit_stop = _truncate(committed, remaining, stop)
        generated.extend(kept)
        lengths.append(len(kept))
        taps = _tap_features(out.hidden_states, tap_layer_ids)[: accepted + 1]  # taps of tokens fed and kept
        _crop(cache, start + accepted + 1)
        if hit_stop or len(generated) >= max_new_tokens:
            reason = "eos" if hit_stop else "max_new_tokens"
            break
        proposer.add_context(taps, positions[: accepted + 1])
        start += accepted + 1
    return DecodeResult(output_ids=generated, acceptance_lengths=lengths, stop_reason=reason, seconds=time.perf_counter() - start_time)


def _accept_sampled(logits: torch.Tensor, draft: Draft, temperature: float, generator) -> tuple[int, int]:
    p = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    q = draft.probs.to(p.device)  # (B-1, V)
    tokens = draft.tokens.to(p.device)
    for k in range(tokens.shape[0]):
        t = int(tokens[k])
        ratio = float(p[k, t] / q[k, t].clamp_min(1e-20))
        u = float(torch.rand((), generator=generator, device=p.device))
        if u >= min(1.0, ratio):
            residual = (p[k] - q[k]).clamp_min(0)
            total = residual.sum()
            dist_k = residual / total if float(total) > 0 else p[k]
            return k, int(torch.multinomial(dist_k, 1, generator=generator))
    return tokens.shape[0], int(torch.multinomial(p[-1], 1, generator=generator))


class DFlashProposer:
    """Drafts a block with a DFlash drafter over the target's frozen embedding and LM head (DFlash2: its selector
    walks the slots; DSpark: its Markov head does, every slot drafting; LiLiCorr: its lattice head does, anchored on
    the newest committed context; Domino: its correction head does, from the anchor's slot on)."""

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, mask_token_id: int) -> None:
        self.drafter = drafter
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.mask_token_id = mask_token_id
        self._cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._anchor: Optional[torch.Tensor] = None
        """LiLiCorr: the context feature of the newest committed token (H,), None before any."""

    def reset(self) -> None:
        self._cache = None
        self._pending = []
        self._anchor = None

    def add_context(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        self._pending.append((taps, positions))

    def propose(self, first_token: int, start: int, block_size: int, temperature: float, generator) -> Draft:
        device = self.embed_weight.device
        dspark = getattr(self.drafter, "markov_w1", None) is not None
        slots = block_size - 1 if dspark else block_size  # DSpark: the anchor's slot drafts too
        ids = torch.full((slots,), self.mask_token_id, dtype=torch.int64, device=device)
        ids[0] = first_token
        taps = torch.cat([t for t, _ in self._pending]) if self._pending else None
        pos = torch.cat([p for _, p in self._pending]) if self._pending else None
        self._pending = []
        dtype = next(self.drafter.parameters()).dtype
        lattice = getattr(self.drafter, "lilicorr", None)
        if lattice is not None and taps is not None:
            self._anchor = self.drafter.context(taps[-1:].to(dtype))[0]  # the slot before this block
        result = self.drafter.forward_block(
            block_embeds=F.embedding(ids, self.embed_weight).to(dtype),
            block_positions=torch.arange(start, start + slots, device=device),
            context_taps=None if taps is None else taps.to(dtype),
            context_positions=pos,
            cache=self._cache,
        )
        self._cache = result.cache
        if dspark:
            logits = F.linear(result.hidden.to(self.lm_head_weight.dtype), self.lm_head_weight).float()  # (B-1, V)
            walked = markov_walk(self.drafter.markov_w1, self.drafter.markov_w2, logits[None], ids[:1], temperature,
                                 generator)
            return Draft(tokens=walked.tokens[0], probs=None if walked.probs is None else walked.probs[0])
        if getattr(self.drafter, "prefix_gru", None) is not None:  # Domino: slots 0..B-2 draft, its head walks them
            walked = domino_walk(self.drafter.prefix_gru, self.drafter.embed_proj, result.hidden[None, :-1],
                                 self.lm_head_weight, self.embed_weight, ids[:1], temperature)
            return Draft(tokens=walked.tokens[0])
        logits = F.linear(result.hidden[1:].to(self.lm_head_weight.dtype), self.lm_head_weight).float()  # (B-1, V)
        if lattice is not None:  # LiLiCorr: the lattice head walks each slot's top-K candidates
            anchor = self._anchor if self._anchor is not None else result.hidden.new_zeros(result.hidden.shape[-1])
            valid = torch.tensor([self._anchor is not None], device=device)
            walked = draft_block(lattice, result.hidden[None, 1:], self.lm_head_weight, self.embed_weight, anchor[None],
                                 valid, temperature, generator)
            return Draft(tokens=walked.tokens[0], probs=None if walked.probs is None else walked.probs[0])
        selector = getattr(self.drafter, "candidate_selector", None)
        if selector is not None:  # DFlash2: the selector walks each slot's top-K candidates
            walked = walk(selector, result.hidden[None, 1:], logits[None], ids[:1], temperature, generator)
            return Draft(tokens=walked.tokens[0], probs=None if walked.probs is None else walked.probs[0])
        if temperature <= 0:
            return Draft(tokens=logits.argmax(-1))
        probs = torch.softmax(logits / temperature, dim=-1)
        return Draft(tokens=torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs=probs)
