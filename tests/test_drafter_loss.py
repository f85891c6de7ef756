"""Drafter loss: weights, chunking (values and grads), KD, simulated acceptance, noise, a tiny overfit."""

from __future__ import annotations

import math
import types

import pytest
import torch

from dflash_trainer.drafter.anchors import plan_from_anchors
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.loss import Teacher, decay_weights, dpace_weights, drafter_loss
from dflash_trainer.drafter.noise import add_tap_noise, noise_std_at
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)


def run_loss(drafter, batch, head, **kw):
    hidden = drafter.forward_train(
        taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight
    )
    return drafter_loss(hidden, batch.plan, lm_head_weight=head, gamma=2.0, **kw)


def test_decay_weights_values():
    assert torch.allclose(decay_weights(4, 7.0, torch.device("cpu")), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


def test_dpace_weights_closed_form():
    ce = torch.tensor([[0.0, math.log(2.0), 0.0]])  # q = 1, 1/2, 1
    valid = torch.tensor([[True, True, False]])  # last label invalid: q = 0
    w = dpace_weights(ce, valid, alpha=0.5)
    q = torch.tensor([1.0, 0.75, 0.5])  # (1 - a) q + a
    prefix = torch.cumprod(q, 0)
    expected = torch.stack([prefix.sum(), prefix[1:].sum(), prefix[2:]. sum()])
    torch.testing.assert_close(w[0], expected)
    assert torch.all(w[0, :-1] >= w[0, 1:])
    assert torch.equal(dpace_weights(ce, valid, alpha=1.0)[0], torch.tensor([3.0, 2.0, 1.0]))


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_chunked_equals_unchunked_values_and_grads(kd_weight):
    drafter, target = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=12)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size) * 0.1
    norm = torch.nn.RMSNorm(drafter.spec.hidden_size)
    teacher = Teacher(last_hidden=torch.randn(batch.taps.shape[0], drafter.spec.hidden_size), final_norm=norm)
    results = []
    for chunk in (5, 10_000):
        drafter.zero_grad()
        out = run_loss(drafter, batch, head, chunk_rows=chunk, kd_weight=kd_weight, teacher=teacher)
        out.loss_sum.backward()
        results.append((out, {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.loss_sum, b.loss_sum)
    assert torch.equal(a.weight_sum, b.weight_sum) and torch.equal(a.slot_correct, b.slot_correct)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dpace", [False, True])
def test_frozen_head_gradient_in_forward_equals_plain_autograd(dpace):
    """The fused path (CE gradient computed in the forward, frozen head) against plain autograd through
    one unchunked logits tensor: same loss, same per-slot hits, same gradient w.r.t. the hidden states."""
    torch.manual_seed(3)
    n, b, h, v = 6, 5, 16, 50
    hidden = torch.randn(n, b, h, requires_grad=True)
    head = torch.randn(v, h) * 0.3
    labels = torch.randint(0, v, (n, b))
    valid = torch.rand(n, b) > 0.3
    valid[:, 0] = False
    plan = types.SimpleNamespace(labels=labels, label_valid=valid, block_valid=torch.ones(n, dtype=torch.bool))
    out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=7, dpace=dpace)
    (grad_fused,) = torch.autograd.grad(out.loss_sum, hidden)

    logits = hidden[:, 1:] @ head.T  # (n, b-1, v)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels[:, 1:].reshape(-1), reduction="none").view(n, b - 1)
    valid_rows = valid[:, 1:]
    weights = (dpace_weights(ce, valid_rows, 0.5) if dpace else decay_weights(b, 2.0, hidden.device)[None]) * valid_rows
    reference = (weights * ce).sum()
    (grad_plain,) = torch.autograd.grad(reference, hidden)
    torch.testing.assert_close(out.loss_sum, reference)
    torch.testing.assert_close(grad_fused, grad_plain, atol=1e-6, rtol=1e-5)
    hits = (logits.argmax(-1) == labels[:, 1:]) & valid_rows
    assert torch.equal(out.slot_correct, hits.float().sum(0))


def test_loss_matches_explicit_formula():
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=20)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size) * 0.1
    plan = batch.plan
    with torch.no_grad():
        hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                       embed_weight=batch.embed_weight)
        out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=7)
    loss = weight = 0.0
    for j in range(plan.num_blocks):
        for k in range(1, 4):
            anchor = int(plan.anchors[j])
            seq_end = int(batch.cu_seqlens[int(plan.seq_id[j]) + 1]) if plan.block_valid[j] else -1
            if not (plan.block_valid[j] and anchor + k < seq_end and batch.loss_mask[anchor + k]):
                continue
            w = math.exp(-(k - 1) / 2.0)
            label = int(batch.input_ids[anchor + k])  # same position, no shift
            loss += w * float(-torch.log_softmax(hidden[j, k] @ head.T, -1)[label])
            weight += w
    assert weight > 0
    assert math.isclose(float(out.weight_sum), weight, rel_tol=1e-5)
    assert math.isclose(float(out.loss_sum), loss, rel_tol=1e-4)


def test_kd_is_zero_when_teacher_matches_and_uses_position_anchor_plus_k_minus_1():
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=10)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size) * 0.1
    # non-overlapping blocks, so each teacher position belongs to one block slot
    plan = plan_from_anchors(anchors=torch.tensor([0, 5, 16, 22, 28]), block_valid=torch.ones(5, dtype=torch.bool),
                             input_ids=batch.input_ids, loss_mask=torch.ones_like(batch.loss_mask),
                             cu_seqlens=batch.cu_seqlens, block_size=4, mask_token_id=drafter.spec.mask_token_id)
    with torch.no_grad():
        hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                       embed_weight=batch.embed_weight)
        # build a teacher whose state at anchor + k - 1 is exactly the drafter's slot k
        last = torch.zeros(batch.taps.shape[0], drafter.spec.hidden_size)
        for j in torch.nonzero(plan.block_valid).flatten().tolist():
            for k in range(1, 4):
                last[int(plan.anchors[j]) + k - 1] = hidden[j, k]
        teacher = Teacher(last_hidden=last, final_norm=lambda x: x)
        kd = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=8, kd_weight=1.0, teacher=teacher)
    assert float(kd.weight_sum) > 0 and abs(float(kd.loss_sum)) < 1e-4


def test_simulated_acceptance_counts_leading_hits():
    hidden_size, vocab = 4, 5
    head = torch.eye(vocab, hidden_size)  # logits = first 4 dims of hidden; argmax = one-hot index
    cu = torch.tensor([0, 10], dtype=torch.int32)
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    plan = plan_from_anchors(anchors=torch.tensor([0, 4]), block_valid=torch.tensor([True, True]), input_ids=ids,
                             loss_mask=torch.ones(10, dtype=torch.bool), cu_seqlens=cu, block_size=4, mask_token_id=4)
    hidden = torch.zeros(2, 4, hidden_size)
    for k, tok in enumerate([1, 2, 0]):  # block 0 labels 1, 2, 3: hits at slots 1, 2, miss at 3
        hidden[0, k + 1, tok] = 5.0
    for k, tok in enumerate([0, 2, 3]):  # block 1 labels 1, 2, 3: miss at slot 1 (later hits do not count)
        hidden[1, k + 1, tok] = 5.0
    out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=4)
    assert float(out.accept_sum) == (2 + 1) + (0 + 1) and float(out.block_count) == 2
    assert out.slot_correct.tolist() == [1.0, 2.0, 1.0] and out.slot_count.tolist() == [2.0, 2.0, 2.0]


def test_tiny_overfit_loss_goes_down():
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=12)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size) * 0.2
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        out = run_loss(drafter, batch, head, chunk_rows=16)
        loss = out.loss_sum / out.weight_sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses


def test_dpace_weights_by_hand_and_the_loss_trains():
    """D-PACE weight of slot k = sum over m >= k of the product of the smoothed confidences up to m; an invalid
    slot counts with confidence 0. Then a few steps on the D-PACE loss lower it."""
    from dflash_trainer.drafter.loss import dpace_weights

    ce = torch.tensor([[0.0, math.log(2.0), math.log(4.0)], [0.0, 0.0, 0.0]])  # confidences 1, 1/2, 1/4
    valid = torch.tensor([[True, True, True], [True, False, True]])
    # alpha 0.5: smoothed 1, 0.75, 0.625 -> prefix products 1, 0.75, 0.46875 -> suffix sums
    # second row: the invalid slot has confidence 0 -> smoothed 1, 0.5, 1 -> prefix 1, 0.5, 0.5
    expected = torch.tensor([[2.21875, 1.21875, 0.46875], [2.0, 1.0, 0.5]])
    torch.testing.assert_close(dpace_weights(ce, valid, 0.5), expected)
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=12)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size) * 0.2
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        out = run_loss(drafter, batch, head, chunk_rows=16, dpace=True, dpace_alpha=0.5)
        optimizer.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        optimizer.step()
        losses.append(float(out.ce_sum / out.weight_sum))
    assert losses[-1] < losses[0] - 0.5, losses


def test_noise_keyed_and_scheduled():
    taps = torch.zeros(64, 32)
    cfg = DrafterConfig(noise="gaussian", noise_std=0.5, noise_std_final=0.1)
    a = add_tap_noise(taps, cfg, progress=0.0, seed=1, epoch=0, job_id=3)
    b = add_tap_noise(taps, cfg, progress=0.0, seed=1, epoch=0, job_id=3)
    c = add_tap_noise(taps, cfg, progress=0.0, seed=1, epoch=0, job_id=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(float(a.std()) - 0.5) < 0.05
    assert math.isclose(noise_std_at(cfg, 0.5), 0.3)
    uni = add_tap_noise(taps, DrafterConfig(noise="uniform", noise_std=0.5), progress=0.3, seed=1, epoch=0, job_id=3)
    assert abs(float(uni.std()) - 0.5) < 0.05 and float(uni.abs().max()) <= 0.5 * math.sqrt(3)
    assert add_tap_noise(taps, DrafterConfig(), progress=0.0, seed=1, epoch=0, job_id=3) is taps


def test_loss_kernel_eager_keeps_the_plain_kernel_on_cuda():
    """`drafter.loss_kernel=eager` selects the uncompiled CE kernel even on CUDA; the CPU is always eager."""
    from dflash_trainer.drafter.loss import _ce_and_logit_grad, _ce_kernel

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _ce_kernel(cuda, compiled=False) is _ce_and_logit_grad
    assert _ce_kernel(cpu, compiled=True) is _ce_and_logit_grad
    assert _ce_kernel(cuda, compiled=True) is not _ce_and_logit_grad  # wrapped by torch.compile (lazily)
