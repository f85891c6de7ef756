"""Batched decoding against the single-sequence loop (itself checked against the reference package).

Exactness: plain batched decoding equals plain decoding of each prompt alone; batched speculative decoding
commits the same tokens with the same acceptance lengths as `speculative_generate`, row by row, for a
fitted DFlash drafter, with stop tokens, and with rows that finish at different steps (compaction).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig

from dflash_trainer.eval.batched import (
    BlockDrafts,
    ContextUpdate,
    _TargetCache,
    accept_greedy,
    accept_sampled,
    decode_batch,
    position_masks,
    sliding_window_of,
)
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.proposers import PromptLookupProposer
from dflash_trainer.eval.speculative import speculative_generate, target_generate
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from dflash_trainer.target.presets import preset_config
from tests.eval_helpers import batch_proposer_for, fitted, proposer_for


def _prompts():
    setup = fitted()
    generator = torch.Generator().manual_seed(5)
    # the fitted prompts plus longer and shorter ones: rows of very different lengths share a batch
    return setup.prompts + [torch.randint(0, 1000, (n,), generator=generator) for n in (3, 31, 7)]


def test_plain_batched_decoding_equals_each_prompt_alone():
    target = fitted().target
    prompts = _prompts()
    results = decode_batch(target, prompts, max_new_tokens=17, stop_token_ids=[])
    for prompt, result in zip(prompts, results):
        ref = target_generate(target, prompt, max_new_tokens=17, stop_token_ids=[])
        assert result.output_ids == ref.output_ids
        assert result.acceptance_lengths == [] and result.stop_reason == "max_new_tokens"


def test_a_target_whose_logits_are_not_finite_is_an_error_not_garbage():
    target = fitted().target  # shared: the hook comes off again
    prompts = _prompts()
    row = torch.tensor([2])
    hook = target.lm_head.register_forward_hook(lambda module, args, out: out.index_fill(0, row, float("nan")))
    try:
        with pytest.raises(ConfigError, match=f"NaN or inf after 1 of {len(prompts)} prompts .the first: prompt 2 "):
            decode_batch(target, prompts, max_new_tokens=4, stop_token_ids=[])
    finally:
        hook.remove()
    assert len(decode_batch(target, prompts, max_new_tokens=4, stop_token_ids=[])[2].output_ids) == 4


@pytest.mark.parametrize("trained, variant", [(False, "dflash"), (True, "dflash"), (True, "dflash2")])
def test_speculative_batched_equals_reference_loop_row_by_row(trained, variant, monkeypatch):
    setup = fitted(variant=variant)
    drafter = setup.drafter if trained else tiny_drafter(seed=3)[0]
    prompts = _prompts()
    compactions = []
    keep = _TargetCache.keep
    monkeypatch.setattr(_TargetCache, "keep", lambda self, rows: (compactions.append(len(rows)), keep(self, rows)))
    lengths = []
    for max_new in (26, 9):  # 9 ends inside a block: the last block shrinks there
        results = decode_batch(setup.target, prompts, proposer=batch_proposer_for(drafter, setup.target), block_size=4,
                               tap_layer_ids=drafter.spec.tap_layer_ids, max_new_tokens=max_new, stop_token_ids=[])
        for prompt, result in zip(prompts, results):
            ref = speculative_generate(setup.target, proposer_for(drafter, setup.target), prompt, block_size=4,
                                       tap_layer_ids=drafter.spec.tap_layer_ids, max_new_tokens=max_new,
                                       stop_token_ids=[])
            assert result.output_ids == ref.output_ids
            assert result.acceptance_lengths == ref.acceptance_lengths
            lengths += result.acceptance_lengths
    if trained:
        assert set(lengths) == {1, 2, 3, 4} or (variant == "dflash2" and {1, 2, 3} <= set(lengths))
        assert compactions  # rows finished at different steps and were dropped while others went on


def test_stop_tokens_end_rows_like_the_reference_loop():
    setup = fitted()
    prompts = _prompts()
    plain = decode_batch(setup.target, prompts, max_new_tokens=30, stop_token_ids=[])
    stop = [plain[2].output_ids[11], plain[0].output_ids[4]]  # tokens that occur mid-output in two rows
    spec = decode_batch(setup.target, prompts, proposer=batch_proposer_for(setup.drafter, setup.target), block_size=4,
                        tap_layer_ids=setup.drafter.spec.tap_layer_ids, max_new_tokens=30, stop_token_ids=stop)
    reasons = set()
    for prompt, result in zip(prompts, spec):
        ref = speculative_generate(setup.target, proposer_for(setup.drafter, setup.target), prompt, block_size=4,
                                   tap_layer_ids=setup.drafter.spec.tap_layer_ids, max_new_tokens=30,
                                   stop_token_ids=stop)
        assert (result.output_ids, result.acceptance_lengths, result.stop_reason) == (
            ref.output_ids, ref.acceptance_lengths, ref.stop_reason)
        reasons.add(result.stop_reason)
    assert reasons == {"eos", "max_new_tokens"}


def test_prompt_lookup_is_lossless_and_copies_repeats():
    setup = fitted()
    prompts = _prompts()
    plain = decode_batch(setup.target, prompts, max_new_tokens=40, stop_token_ids=[])
    # a prompt that contains its own greedy continuation: lookup drafts it, so whole blocks are accepted
    echo = torch.cat([prompts[1], torch.tensor(plain[1].output_ids[:30]), prompts[1]])
    echo_ref = target_generate(setup.target, echo, max_new_tokens=40, stop_token_ids=[])
    rows = prompts + [echo]
    out = decode_batch(setup.target, rows, proposer=PromptLookupProposer(max_ngram=3), block_size=8,
                       max_new_tokens=40, stop_token_ids=[])
    for result, ref in zip(out, [p.output_ids for p in plain] + [echo_ref.output_ids]):
        assert result.output_ids == ref
        assert sum(result.acceptance_lengths) == len(result.output_ids) - 1
    echo_lengths = out[-1].acceptance_lengths
    if echo_ref.output_ids[:29] == plain[1].output_ids[1:30]:  # the target repeats itself after the echo
        assert max(echo_lengths) == 8


def gemma3_image_text_target(folder) -> str:
    """A tiny Gemma 3 image-text-to-text config (sliding window 4 and full attention), saved: its window sits in its
    text config."""
    from transformers import Gemma3Config

    Gemma3Config(text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"]),
                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma3-image-text"])
def test_speculative_decoding_is_lossless_on_a_sliding_window_target(arch, tmp_path):
    """gpt-oss layers alternate sliding (window 4) and full attention, and so do these Gemma 3 ones (an
    image-text-to-text target, run on text). Rejected drafts stay in the batch's cache as masked slots, so a window
    that counted slots (HF's masks and sliding caches) would lose committed tokens and change the output."""
    random_init = "tiny-gpt-oss" if arch == "gpt-oss" else gemma3_image_text_target(tmp_path)
    target = load_target(TargetConfig(random_init=random_init, attn_implementation="eager", dtype="float32",
                                      compile=False), torch.device("cpu"), seed=0)
    assert sliding_window_of(target.config) == 4
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=generator) for n in (12, 5, 20)]
    prompts.append(torch.cat([prompts[0]] * 3))  # repeats: lookup drafts get accepted
    out = decode_batch(target, prompts, proposer=PromptLookupProposer(max_ngram=3), block_size=8, max_new_tokens=30,
                       stop_token_ids=[])
    plain = decode_batch(target, prompts, max_new_tokens=30, stop_token_ids=[])  # left-padded rows, one token a step
    for prompt, result, plain_result in zip(prompts, out, plain):
        alone = target_generate(target, prompt, max_new_tokens=30, stop_token_ids=[]).output_ids
        assert result.output_ids == plain_result.output_ids == alone
    lengths = [n for result in out for n in result.acceptance_lengths]
    assert max(lengths) > 1 and min(lengths) == 1  # drafts both accepted and rejected


def test_position_masks_count_positions_and_skip_invalid_slots():
    # one row: slots at positions 0, 1, 2 (slot 2 rejected, masked), then 2, 3 (the next block)
    key_positions = torch.tensor([[0, 1, 2, 2, 3]])
    key_valid = torch.tensor([[True, True, False, True, True]])
    masks = position_masks(key_valid, key_positions, torch.tensor([[2, 3]]), window=2, chunk=2, dtype=torch.float32)
    full, sliding, chunked = masks["full_attention"], masks["sliding_attention"], masks["chunked_attention"]
    assert full.shape == sliding.shape == chunked.shape == (1, 1, 2, 5)
    assert (full[0, 0] == 0).tolist() == [[True, True, False, True, False], [True, True, False, True, True]]
    assert (sliding[0, 0] == 0).tolist() == [[False, True, False, True, False], [False, False, False, True, True]]
    # chunks of 2 positions: {0, 1}, {2, 3}
    assert (chunked[0, 0] == 0).tolist() == [[False, False, False, True, False], [False, False, False, True, True]]
    assert full.min() == torch.finfo(torch.float32).min
    assert set(position_masks(key_valid, key_positions, torch.tensor([[2, 3]]), window=None, dtype=torch.float32)) == {
        "full_attention"}


def test_sliding_window_of_reads_layer_types_then_the_window():
    qwen3 = preset_config("tiny")
    assert sliding_window_of(qwen3) is None  # layer_types all full attention
    assert sliding_window_of(preset_config("tiny-gpt-oss")) == 4
    assert sliding_window_of(MistralConfig(num_hidden_layers=2, sliding_window=64)) == 64  # no layer_types
    assert sliding_window_of(MistralConfig(num_hidden_layers=2, sliding_window=None)) is None
    # other kinds of layers beside the sliding ones (linear attention, convolutions) keep HF's own masks
    mixed = SimpleNamespace(layer_types=["sliding_attention", "linear_attention"], sliding_window=4)
    assert sliding_window_of(mixed) is None


def test_ngram_lookup_takes_the_latest_longest_match():
    proposer = PromptLookupProposer(max_ngram=2, min_ngram=1)
    tokens = torch.tensor([[1, 2, 3, 9, 1, 2, 4, 5, 2]])
    proposer.observe(ContextUpdate(tokens=tokens, positions=torch.arange(9)[None],
                                   valid=torch.ones_like(tokens, dtype=torch.bool), taps=None))
    # context ... 5 2 | last 1 -> suffix (2, 1) never occurred; (1,) last occurred at index 4 -> 2 4 5 2 1
    drafts = proposer.propose(torch.tensor([1]), torch.tensor([9]), torch.tensor([3]), 8, 0.0, None)
    assert drafts.lengths.tolist() == [3] and drafts.tokens[0, :3].tolist() == [2, 4, 5]
    # a suffix of two: (1, 2) occurred at 0 and 4: the latest (4) wins -> 4 5 2
    proposer.observe(ContextUpdate(tokens=torch.tensor([[1, 2]]), positions=torch.tensor([[9, 10]]),
                                   valid=torch.tensor([[True, True]]), taps=None))
    drafts = proposer.propose(torch.tensor([7]), torch.tensor([11]), torch.tensor([7]), 8, 0.0, None)
    assert drafts.lengths.tolist() == [0]  # (2, 7) and (7,) never occurred
    proposer = PromptLookupProposer(max_ngram=2, min_ngram=1)
    proposer.observe(ContextUpdate(tokens=tokens, positions=torch.arange(9)[None],
                                   valid=torch.ones_like(tokens, dtype=torch.bool), taps=None))
    drafts = proposer.propose(torch.tensor([4]), torch.tensor([9]), torch.tensor([7]), 8, 0.0, None)
    assert drafts.tokens[0, : int(drafts.lengths[0])].tolist() == [5, 2, 4]  # (2, 4) at 5 -> 5 2 then (4) again


def test_greedy_acceptance_rule():
    logits = torch.full((2, 4, 10), -5.0)
    for r, row in enumerate([[3, 4, 5, 6], [1, 2, 3, 4]]):
        for k, t in enumerate(row):
            logits[r, k, t] = 5.0
    drafts = BlockDrafts(tokens=torch.tensor([[3, 4, 9], [1, 2, 3]]), lengths=torch.tensor([3, 2]))
    accepted, bonus = accept_greedy(logits, drafts)
    # row 0: 3 ok, 4 ok, 9 != 5 -> 2 accepted, bonus 5; row 1: only 2 drafts count -> 2, bonus 3
    assert accepted.tolist() == [2, 2] and bonus.tolist() == [5, 3]


def test_sampled_acceptance_keeps_the_target_distribution():
    """One draft slot, target p and drafter q over 3 tokens: the first committed token is distributed as p."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    n = 40000
    logits = torch.log(p).expand(n, 2, 3).clone()
    generator = torch.Generator().manual_seed(1)
    draft = torch.multinomial(q.expand(n, 3), 1, replacement=True, generator=generator)  # (n, 1)
    drafts = BlockDrafts(tokens=draft, lengths=torch.ones(n, dtype=torch.int64), probs=q.expand(n, 1, 3))
    accepted, bonus = accept_sampled(logits, drafts, 1.0, generator)
    first = torch.where(accepted > 0, draft[:, 0], bonus)
    freq = torch.bincount(first, minlength=3).float() / n
    assert torch.allclose(freq, p, atol=0.01), freq
    # point-mass drafts (prompt lookup): always draft token 2
    drafts = BlockDrafts(tokens=torch.full((n, 1), 2), lengths=torch.ones(n, dtype=torch.int64))
    accepted, bonus = accept_sampled(logits, drafts, 1.0, generator)
    first = torch.where(accepted > 0, torch.full_like(bonus, 2), bonus)
    freq = torch.bincount(first, minlength=3).float() / n
    assert torch.allclose(freq, p, atol=0.01), freq


# -- held-out validation: walk tau ------------------------------------------------------------------


def test_walk_restarts_after_each_rejection_and_stops_at_the_budget():
    from dflash_trainer.eval.validation import reply_spans, walk

    assert reply_spans([0, 1, 1, 1, 0, 0, 1, 1]) == [(1, 3), (6, 7)]
    acceptance = [0, 3, 1, 1, 4, 2, 1, 9, 9, 9, 9]
    assert walk(acceptance, 1, 10, 100) == [3, 4, 2]  # 1 -> 4 -> 8 -> 10 (the last block is cut at the end)
    assert walk(acceptance, 1, 10, 5) == [3, 1]  # five tokens: indices 1..5
    assert walk(acceptance, 3, 3, 100) == []  # a one-token reply: the prefill commits it, no step


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_walk_tau_equals_real_decoding_on_greedy_replies(variant):
    """On replies that are the target's own greedy output, the walk over teacher-forced blocks gives the same
    acceptance lengths as real speculative decoding of the prompts, in the same total (DFlash2: teacher-forced
    selector picks along an accepted prefix are the greedy walk's)."""
    from dflash_trainer.data.tokenized import TokenizedDataset
    from dflash_trainer.data.types import Conversation, Message, TokenizedSequence
    from dflash_trainer.eval.validation import HeldOutValidator
    from dflash_trainer.target.capture import TapCapture
    from dflash_trainer.target.head import head_from_model
    from dflash_trainer.transport.wire import WireSpec, allocate

    setup = fitted(variant=variant)
    spec = setup.drafter.spec
    prompts = _prompts()
    max_new = 24
    real = decode_batch(setup.target, prompts, proposer=batch_proposer_for(setup.drafter, setup.target),
                        block_size=spec.block_size, tap_layer_ids=spec.tap_layer_ids, max_new_tokens=max_new,
                        stop_token_ids=[])
    replies = decode_batch(setup.target, prompts, max_new_tokens=max_new + 6, stop_token_ids=[])
    sequences = []
    for prompt, reply in zip(prompts, replies):
        ids = torch.cat([prompt, torch.tensor(reply.output_ids)])
        mask = torch.arange(ids.shape[0]) >= prompt.shape[0]
        sequences.append((Conversation(messages=(Message(role="user", content="x"),), source="t", source_index=0),
                          TokenizedSequence(input_ids=ids, loss_mask=mask)))
    dataset = TokenizedDataset.from_sequences(sequences)
    wire = WireSpec(token_budget=96, max_seqs=4, num_taps=spec.num_taps, hidden=spec.hidden_size,
                    dtype=torch.float32, has_last_hidden=False)
    validator = HeldOutValidator(
        capture=TapCapture(setup.target, spec.tap_layer_ids), dataset=dataset, buffers=allocate(wire, "cpu"),
        head=head_from_model(setup.target), num_blocks=16, gamma=2.0, max_new_tokens=max_new,
        compute_dtype=torch.float32, chunk_rows=64)
    report = validator.run(setup.drafter)
    real_steps = [n for r in real for n in r.acceptance_lengths]
    assert report.replies == len(prompts) and report.walk_steps == len(real_steps)
    assert report.walk_tau == pytest.approx(sum(real_steps) / len(real_steps))
    assert report.walk_tau > 1.2  # the fitted drafter drafts beyond the bonus token
    assert report.anchors == sum(max_new + 6 - 1 for _ in prompts)  # every anchor of every reply
    assert len(report.slot_accuracy) == spec.block_size - 1 and report.loss > 0
    # in the training step's chunks (long sequences: the context once a batch, 5 anchors a forward) it is the same
    chunked = validator.run(setup.drafter, blocks_per_chunk=5)
    assert (chunked.walk_steps, chunked.anchors, chunked.replies) == (report.walk_steps, report.anchors, report.replies)
    for name in ("loss", "accuracy", "sim_tau", "walk_tau"):
        assert getattr(chunked, name) == pytest.approx(getattr(report, name), rel=1e-5, abs=1e-6), name
    assert chunked.slot_accuracy == pytest.approx(report.slot_accuracy, abs=1e-6)


def test_decoding_runs_every_attention_without_cudnn(monkeypatch):
    """cuDNN's attention builds a plan per new key length, and every decode step has a new one: decoding (target
    and drafter forwards alike) runs with it off, and the setting is restored afterwards."""
    setup = fitted()
    drafter = setup.drafter
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    decode_batch(setup.target, setup.prompts, proposer=batch_proposer_for(drafter, setup.target), block_size=4,
                 tap_layer_ids=drafter.spec.tap_layer_ids, max_new_tokens=6, stop_token_ids=[])
    target_generate(setup.target, setup.prompts[0], max_new_tokens=3, stop_token_ids=[])
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
