"""LiLiCorr (`drafter.variant: lilicorr`, with and without DFlash2's convolutions): its lattice head and its
training terms against slow references, its start from a DFlash drafter, its training, export, and decoding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter, read_export
from dflash_trainer.drafter.lilicorr import (LatticeLoss, LatticeSpec, candidates, chunk_terms, lattice_loss, lattice_term,
                                             walk_lattice)
from dflash_trainer.drafter.loss import drafter_loss
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.batched import decode_batch
from dflash_trainer.eval.evaluate import evaluate_tau
from dflash_trainer.eval.speculative import speculative_generate, target_generate
from tests import test_batched_decode as decode_tests
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401
from tests.eval_helpers import LATTICE_SIZES, batch_proposer_for, fitted, proposer_for, target_taps

CONV = dict(lilicorr_conv=True, conv_kernel_size=2, conv_group_size=16)


def lilicorr(seed: int = 0, conv: bool = False, **kw):
    return tiny_drafter(variant="lilicorr", seed=seed, **{**LATTICE_SIZES, **(CONV if conv else {}), **kw})


@torch.no_grad()
def perturb(drafter, seed: int = 11, scale: float = 0.3) -> None:
    """Move the lattice head (and the convolutions) off their start, so that parity tests exercise every term."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if "_conv." in name or "lilicorr." in name:
            p.add_(scale * torch.randn(p.shape, generator=gen))


def slow_scores(head, tokens, log_probs, pass_hidden, anchor, valid):
    """The head's log-factors the long way: nn.MultiheadAttention with the bias built pair by pair, the features
    one candidate at a time, every cosine by hand."""
    rows, slots, k = log_probs.shape
    spec = head.lattice
    h = head.pass_hidden_proj.out_features
    x = torch.zeros(rows, slots, k, h)
    for r in range(rows):
        for s in range(slots):
            top = log_probs[r, s].max()
            for j in range(k):
                lp = log_probs[r, s, j]
                feats = torch.stack([lp, lp.exp(), lp - top, torch.tensor(j / max(k - 1, 1)), torch.tensor(float(j == 0))])
                tok = head.token_proj(tokens[r, s, j]) if hasattr(head, "token_proj") else tokens[r, s, j]
                x[r, s, j] = (tok + head.pass_hidden_proj(pass_hidden[r, s]) + head.feature_mlp(head.feature_norm(feats))
                              + head.slot_embedding[0, 0, s, 0] + head.rank_embedding[0, 0, 0, j])
    x = x.reshape(rows, slots * k, h)
    bias = torch.zeros(spec.num_heads, slots * k, slots * k)
    for q in range(slots * k):
        for c in range(slots * k):
            sq, sc = q // k, c // k
            bias[:, q, c] = head.relative_slot_bias[:, sq - sc + head.block_size - 1] + (sq == sc) * head.same_slot_bias
    for layer in head.layers:
        mha = torch.nn.MultiheadAttention(h, spec.num_heads, batch_first=True)
        mha.in_proj_weight.data.copy_(layer.attn.in_proj_weight)
        mha.in_proj_bias.data.copy_(layer.attn.in_proj_bias)
        mha.out_proj.weight.data.copy_(layer.attn.out_proj.weight)
        mha.out_proj.bias.data.copy_(layer.attn.out_proj.bias)
        y = layer.attn_norm(x)
        x = x + mha(y, y, y, attn_mask=bias.repeat(rows, 1, 1), need_weights=False)[0]
        x = x + layer.mlp.down_proj(F.silu(layer.mlp.up_proj(layer.mlp_norm(x))))
    x = head.output_norm(x).reshape(rows, slots, k, h)
    a = head.anchor_norm(head.context_proj(anchor) * valid[:, None].float())

    def unit(v):
        return v / max(float(v.norm()), spec.vector_eps)

    start = torch.zeros(rows, k)
    pair = torch.zeros(rows, slots - 1, k, k)
    for r in range(rows):
        f = F.silu(head.factor_input_proj(torch.cat([x[r], a[r].expand_as(x[r]), x[r] * a[r]], -1)))
        a_out = unit(head.anchor_out_head(a[r]))
        for s in range(slots):
            for j in range(k):
                if s == 0:
                    start[r, j] = spec.logit_scale * unit(head.in_head(f[0, j])) @ a_out
                if s + 1 < slots:
                    for i in range(k):
                        pair[r, s, j, i] = spec.logit_scale * unit(head.out_head(f[s, j])) @ unit(head.in_head(f[s + 1, i]))
    return start, pair


@pytest.mark.parametrize("slots", [3, 2])
def test_lattice_head_matches_a_slow_reference(slots):
    """Every slot, and a shorter block (decoding near its end scores the first slots only)."""
    drafter, _ = lilicorr(block_size=4)
    perturb(drafter)
    head = drafter.lilicorr
    gen = torch.Generator().manual_seed(3)
    rows, k, hm = 3, head.top_k, drafter.spec.hidden_size
    tokens = torch.randn(rows, slots, k, hm, generator=gen)
    log_probs = torch.randn(rows, slots, k, generator=gen).sort(-1, descending=True).values - 2.0
    pass_hidden, anchor = torch.randn(rows, slots, hm, generator=gen), torch.randn(rows, hm, generator=gen)
    valid = torch.tensor([True, False, True])
    with torch.no_grad():
        start, pair = head(tokens, log_probs, pass_hidden, anchor, valid)
        want_start, want_pair = slow_scores(head, tokens, log_probs, pass_hidden, anchor, valid)
    torch.testing.assert_close(start, want_start, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pair, want_pair, atol=1e-4, rtol=1e-4)
    assert start.abs().max() <= head.lattice.logit_scale + 1e-4  # scaled cosines
    assert start.std() > 0.1 and pair.std() > 0.1  # a perturbed head scores candidates apart


def test_walk_is_the_greedy_chain_and_samples_its_distribution():
    gen = torch.Generator().manual_seed(0)
    rows, slots, k, vocab = 5, 3, 4, 30
    start, pair = torch.randn(rows, k, generator=gen), torch.randn(rows, slots - 1, k, k, generator=gen)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[: slots * k].view(slots, k) for _ in range(rows)])
    walked = walk_lattice(start, pair, ids, 0.0, None, vocab)
    for r in range(rows):
        pick = int(start[r].argmax())
        want = [int(ids[r, 0, pick])]
        for s in range(1, slots):
            pick = int(pair[r, s - 1, pick].argmax())
            want.append(int(ids[r, s, pick]))
        assert walked.tokens[r].tolist() == want
    assert walked.probs is None
    # sampling: slot 1's pick follows softmax(pair[prev] / T) given the slot-0 pick, and `probs` says so
    many = 4000
    sampled = walk_lattice(start[:1].expand(many, -1), pair[:1].expand(many, -1, -1, -1), ids[:1].expand(many, -1, -1),
                           0.7, torch.Generator().manual_seed(1), vocab)
    first = sampled.tokens[:, 0]
    q0 = torch.softmax(start[0] / 0.7, -1)
    torch.testing.assert_close(sampled.probs[0, 0, ids[0, 0]], q0)
    assert sampled.probs[0, 0].sum() == pytest.approx(1.0) and (sampled.probs[0, 0] > 0).sum() == k
    for j in range(k):
        share = float((first == ids[0, 0, j]).float().mean())
        assert share == pytest.approx(float(q0[j]), abs=0.03)
        rows_j = first == ids[0, 0, j]
        if rows_j.sum() > 0:
            torch.testing.assert_close(sampled.probs[rows_j][0, 1, ids[0, 1]], torch.softmax(pair[0, 0, j] / 0.7, -1))


def slow_lattice_mean(start, pair, ids, labels, label_valid, w, target=None):
    """ModelOpt's three terms one block and one slot at a time."""
    total, count = 0.0, 0
    for n in range(ids.shape[0]):
        if not bool(label_valid[n].all()):
            continue
        prev = None
        for s in range(ids.shape[1]):
            where = (ids[n, s] == labels[n, s]).nonzero()
            if where.numel() == 0:
                break  # the slots after a miss are not supervised
            t = int(where[0])
            node = start[n] if s == 0 else pair[n, s - 1, prev]
            loss = w["ce"] * -torch.log_softmax(node, -1)[t]
            others = [float(node[j].detach()) for j in range(node.numel()) if j != t]
            loss = loss + w["margin"] * max(0.0, w["width"] - (float(node[t].detach()) - max(others)))
            if target is not None:
                gap = (target[n, s, t] - target[n, s]).clamp_min(0)
                loss = loss + w["pen"] * (torch.softmax(node, -1) * gap).sum()
            total, count, prev = total + loss, count + 1, t
    return total / max(count, 1)


def test_lattice_terms_match_a_slow_reference_and_train_the_backbone():
    drafter, _ = lilicorr(block_size=5)
    perturb(drafter)
    gen = torch.Generator().manual_seed(5)
    n, slots, k, hm, vocab = 6, 4, drafter.lilicorr.top_k, drafter.spec.hidden_size, 40
    ids = torch.stack([torch.randperm(vocab, generator=gen)[: slots * k].view(slots, k) for _ in range(n)])
    labels = ids.gather(-1, torch.randint(0, k, (n, slots, 1), generator=gen))[..., 0]
    labels[1, 2] = vocab + 1  # a miss mid-block: slots 2, 3 of block 1 unsupervised
    labels[2, 0] = vocab + 1  # a miss at slot 0: none of block 2
    label_valid = torch.ones(n, slots, dtype=torch.bool)
    label_valid[3, 3] = False  # a partly supervised block: none of block 3
    taps = torch.randn(30, drafter.spec.num_taps * hm, generator=gen)
    teacher_table = torch.randn(40, vocab + 2, generator=gen)  # the target's logits at each packed position
    anchors = torch.tensor([5, 9, 12, 20, 0, 25])
    anchor_pos = torch.tensor([3, 0, 4, 6, 0, 2])
    log_probs = torch.randn(n, slots, k, generator=gen).requires_grad_(True)
    hidden = torch.randn(n, slots, hm, generator=gen).requires_grad_(True)
    embed = torch.randn(vocab + 2, hm, generator=gen)
    w = dict(ce=0.3, margin=0.2, width=2.0, pen=0.5)
    loss = LatticeLoss(head=drafter.lilicorr, w_ce=w["ce"], w_margin=w["margin"], w_pen=w["pen"], margin=w["width"],
                       embed_weight=embed, anchor_context=lambda rows: drafter.anchor_context(taps[rows]),
                       teacher_logits=lambda where, cand: teacher_table[where].gather(-1, cand))
    term = lattice_term(loss, ids=ids, log_probs=log_probs, hidden=hidden, labels=labels, label_valid=label_valid,
                        anchors=anchors, anchor_pos=anchor_pos)
    with torch.no_grad():
        anchor = drafter.context(taps[(anchors - 1).clamp(min=0)]) * (anchor_pos > 0)[:, None]
        start, pair = drafter.lilicorr(embed[ids], log_probs, hidden, anchor, anchor_pos > 0)
    teacher = teacher_table[anchors[:, None] + torch.arange(slots)].gather(-1, ids)  # (n, S, K)
    want = slow_lattice_mean(start, pair, ids, labels, label_valid, w, teacher)
    torch.testing.assert_close(term.mean.detach(), torch.as_tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert torch.equal(term.hit, walk_lattice(start, pair, ids, 0.0, None, vocab).tokens == labels)
    term.mean.backward()
    assert log_probs.grad.abs().sum() > 0 and hidden.grad.abs().sum() > 0  # the backbone learns from it
    assert drafter.fc.weight.grad.abs().sum() > 0  # through the anchor context
    assert drafter.lilicorr.out_head.weight.grad.abs().sum() > 0
    # in chunks of blocks (each recomputed in the backward): the same value, hits and gradients
    grads = [t.grad.clone() for t in (log_probs, hidden, drafter.fc.weight, drafter.lilicorr.in_head.weight)]
    for t in (log_probs, hidden, drafter.fc.weight, drafter.lilicorr.in_head.weight):
        t.grad = None
    chunked = lattice_term(loss, ids=ids, log_probs=log_probs, hidden=hidden, labels=labels, label_valid=label_valid,
                           anchors=anchors, anchor_pos=anchor_pos, chunk_blocks=4)
    chunked.mean.backward()
    torch.testing.assert_close(chunked.mean, term.mean)
    assert torch.equal(chunked.hit, term.hit)
    for want, t in zip(grads, (log_probs, hidden, drafter.fc.weight, drafter.lilicorr.in_head.weight)):
        torch.testing.assert_close(t.grad, want)
    with pytest.raises(ConfigError, match="lilicorr_w_pen > 0 needs the target's logits"):
        lattice_term(LatticeLoss(**{**{f: getattr(loss, f) for f in LatticeLoss.__dataclass_fields__},
                                    "teacher_logits": None}), ids=ids, log_probs=log_probs, hidden=hidden,
                     labels=labels, label_valid=label_valid, anchors=anchors, anchor_pos=anchor_pos)


@pytest.mark.parametrize("pen", [True, False])
def test_the_lattice_kernel_is_one_graph_with_the_eager_values_and_gradients(pen):
    """What CUDA runs compiled (`drafter.loss_kernel: compiled`): traced whole (fullgraph: a graph break fails), the
    same terms, factors and gradients as eager (Inductor on CUDA: tests/test_lilicorr_gpu.py)."""
    check_lattice_kernel(pen, "cpu", "aot_eager", tol=1e-5)


def check_lattice_kernel(pen: bool, device: str, backend: str, tol: float) -> None:
    """`chunk_terms` compiled whole with `backend` on `device` gives eager's terms, factors and gradients."""
    drafter, _ = lilicorr(block_size=5)
    perturb(drafter)
    head = drafter.lilicorr.to(device)
    gen = torch.Generator().manual_seed(7)
    n, slots, k, hm, vocab = 5, 4, head.top_k, drafter.spec.hidden_size, 30
    ids = torch.stack([torch.randperm(vocab, generator=gen)[: slots * k].view(slots, k) for _ in range(n)])
    labels = ids.gather(-1, torch.randint(0, k, (n, slots, 1), generator=gen))[..., 0]
    labels[1, 2] = vocab + 1  # a miss mid-block
    label_valid = torch.ones(n, slots, dtype=torch.bool)
    label_valid[3, 0] = False
    inputs = dict(tokens=torch.randn(n, slots, k, hm, generator=gen), log_probs=torch.randn(n, slots, k, generator=gen),
                  hidden=torch.randn(n, slots, hm, generator=gen), anchor=torch.randn(n, hm, generator=gen))
    target = torch.randn(n, slots, k, generator=gen).to(device) if pen else None
    weights = (0.3, 0.2, 0.5 if pen else 0.0, 2.0)
    compiled = torch.compile(chunk_terms, backend=backend, fullgraph=True, dynamic=False)
    ids, labels, label_valid = ids.to(device), labels.to(device), label_valid.to(device)
    results = []
    for fn in (chunk_terms, compiled):
        leaves = {key: t.to(device, copy=True).requires_grad_(key != "tokens") for key, t in inputs.items()}
        head.zero_grad()
        out = fn(head, leaves["tokens"], leaves["log_probs"], leaves["hidden"], leaves["anchor"],
                 torch.tensor([True, False, True, True, True], device=device), ids, labels, label_valid, target,
                 weights)
        out[0].backward()
        results.append((out, [leaves[key].grad for key in ("log_probs", "hidden", "anchor")],
                        [p.grad.clone() for p in (head.in_head.weight, head.layers[0].attn.in_proj_weight,
                                                  head.relative_slot_bias)]))
    (eager, eager_in, eager_params), (traced, traced_in, traced_params) = results
    assert float(eager[1]) == 14.0  # supervised slots: 5 blocks x 4, less block 3 (a label invalid), less 2 of block 1
    for want, got in zip([*eager, *eager_in, *eager_params], [*traced, *traced_in, *traced_params]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert eager_params[2].abs().sum() > 0  # the attention's bias learns


@pytest.mark.parametrize("preset, setting, width, recorded", [
    ("qwen3-8b", None, 1024, 1024),  # the default: ModelOpt's recipe, a quarter of the 8B drafter, token_proj on
    ("qwen3-8b", 0, 4096, 0),
    ("tiny", None, 64, 0),  # no wider than the drafter: its width, recorded as 0 (no token_proj), as the engines read
    ("tiny", 64, 64, 0),
    ("tiny", 32, 32, 32),
])
def test_the_lattice_head_is_1024_wide_by_default_and_never_wider_than_the_drafter(preset, setting, width, recorded):
    from dflash_trainer.drafter.lilicorr import lattice_key_names
    from dflash_trainer.drafter.spec import drafter_spec
    from dflash_trainer.target.presets import preset_config

    sizes = {} if setting is None else {"lilicorr_hidden_size": setting}
    spec = drafter_spec(preset_config(preset), DrafterConfig(variant="lilicorr", mask_token_id=1, **sizes))
    assert spec.lattice.width(spec.hidden_size) == width
    assert spec.lattice.export_fields()["lilicorr_hidden_size"] == recorded
    names = lattice_key_names(spec.lattice, model_hidden=spec.hidden_size, block_size=spec.block_size)
    assert ("lilicorr.token_proj.weight" in names) == (width != spec.hidden_size)


def small_vocab_batch(drafter, vocab: int, seed: int = 1, num_blocks: int = 12):
    """A packed batch whose tokens are below `vocab`, with an LM head of `vocab` rows: with K >= vocab every true
    token is among the candidates, so every slot of a fully supervised block is supervised."""
    batch = packed_batch(drafter, num_blocks=num_blocks, seed=seed)
    ids = batch.input_ids % vocab
    supervised = torch.arange(ids.shape[0]) < int(batch.cu_seqlens[-1])  # every real token: whole blocks supervised
    plan = plan_blocks(input_ids=ids, loss_mask=supervised, cu_seqlens=batch.cu_seqlens, num_blocks=num_blocks,
                       block_size=drafter.spec.block_size, mask_token_id=drafter.spec.mask_token_id, seed=0, epoch=0,
                       job_id=0)
    head = torch.randn(vocab, drafter.spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    return batch, plan, head


@pytest.mark.parametrize("conv", [False, True])
def test_drafter_loss_adds_the_lattice_mean_and_counts_the_walks_picks(conv):
    drafter, _ = lilicorr(conv=conv)
    perturb(drafter)
    k = drafter.lilicorr.top_k
    batch, plan, head = small_vocab_batch(drafter, vocab=k)
    last_hidden = torch.randn(batch.taps.shape[0], drafter.spec.hidden_size)
    dcfg = DrafterConfig(variant="lilicorr", block_size=4, gamma=2.0, lilicorr_w_margin=0.1)
    lattice = lattice_loss(dcfg, drafter, taps=batch.taps, embed=batch.embed_weight, lm_head=head,
                           last_hidden=last_hidden, final_norm=torch.tanh)
    hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan, embed_weight=batch.embed_weight)
    base = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=7)
    out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=7, lattice=lattice)
    # the reference: the candidates' log-probabilities from a full log-softmax, the target's logits by hand
    logits = hidden[:, 1:] @ head.T  # (N, B-1, V)
    ids, log_probs = candidates(logits, k)
    labels, valid = plan.labels[:, 1:], plan.label_valid[:, 1:]
    assert valid.all(-1).sum() >= 3  # some fully supervised blocks
    where = (plan.anchors[:, None] + torch.arange(3)).clamp(max=batch.taps.shape[0] - 1)
    target = torch.einsum("nsh,nskh->nsk", torch.tanh(last_hidden[where]), head[ids])
    anchor = drafter.context(batch.taps[(plan.anchors - 1).clamp(min=0)]) * (plan.anchor_pos > 0)[:, None]
    start, pair = drafter.lilicorr(batch.embed_weight[ids], log_probs, hidden[:, 1:], anchor, plan.anchor_pos > 0)
    w = dict(ce=dcfg.lilicorr_w_ce, margin=0.1, width=dcfg.lilicorr_margin, pen=dcfg.lilicorr_w_pen)
    want = slow_lattice_mean(start, pair, ids, labels, valid, w, target)
    torch.testing.assert_close(out.loss_sum, base.loss_sum + want * base.weight_sum, atol=1e-4, rtol=1e-5)
    assert torch.equal(out.weight_sum, base.weight_sum) and torch.equal(out.ce_sum, base.ce_sum)
    picks = walk_lattice(start, pair, ids, 0.0, None, k).tokens
    hits = (picks == labels) & valid
    assert torch.equal(out.slot_correct, hits.float().sum(0))
    assert torch.equal(out.block_accept, (hits.float().cumprod(1).sum(1) + 1) * plan.block_valid.float())


@pytest.mark.parametrize("conv", [False, True])
def test_the_lattice_terms_train(conv):
    """A few Adam steps on the lattice terms (with the DFlash loss) lower them, and the walk's hits go up."""
    drafter, _ = lilicorr(conv=conv)
    k = drafter.lilicorr.top_k
    batch, plan, head = small_vocab_batch(drafter, vocab=k, num_blocks=16)
    dcfg = DrafterConfig(variant="lilicorr", block_size=4, gamma=2.0, lilicorr_w_ce=1.0, lilicorr_w_pen=0.0)
    lattice = lattice_loss(dcfg, drafter, taps=batch.taps, embed=batch.embed_weight, lm_head=head, last_hidden=None,
                           final_norm=None)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    history = []
    for _ in range(25):
        hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                       embed_weight=batch.embed_weight)
        out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=64, lattice=lattice)
        base = drafter_loss(hidden.detach(), plan, lm_head_weight=head, gamma=2.0, chunk_rows=64)
        history.append((float((out.loss_sum - base.loss_sum) / out.weight_sum), float(out.slot_correct.sum())))
        optimizer.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        optimizer.step()
    assert history[-1][0] < 0.5 * history[0][0], history
    assert history[-1][1] > history[0][1], history


@pytest.mark.parametrize("conv", [False, True])
def test_a_new_lilicorr_starts_where_the_dflash_drafter_of_its_seed_is(conv, tmp_path):
    """The backbone draws as DFlash's (the convolutions the identity); started from a DFlash export it computes
    that drafter's hidden states."""
    base, target = tiny_drafter(seed=3)
    new, _ = lilicorr(seed=3, conv=conv)
    assert all(torch.equal(new.state_dict()[k], v) for k, v in base.state_dict().items())
    with torch.no_grad():
        base.fc.weight.mul_(3.0)
    export_drafter(base, tmp_path / "dflash", target_config=target)
    init_from_export(new, tmp_path / "dflash")
    batch = packed_batch(base, num_blocks=8)
    with torch.no_grad():
        args = dict(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight)
        torch.testing.assert_close(new.forward_train(**args), base.forward_train(**args), atol=0, rtol=0)


@pytest.mark.parametrize("conv", [False, True])
def test_export_round_trip_in_the_engines_format_and_warm_start_rules(conv, tmp_path):
    drafter, target = lilicorr(conv=conv)
    perturb(drafter)
    export_drafter(drafter, tmp_path / "l", target_config=target)
    config = json.loads((tmp_path / "l" / "config.json").read_text())
    dflash = config["dflash_config"]
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert dflash["lilicorr_enabled"] is True and dflash["block_size"] == config["block_size"] == 4
    assert {k: dflash[f"lilicorr_{k}"] for k in ("candidate_topk", "num_heads", "hidden_size", "factor_dim")} == {
        k.removeprefix("lilicorr_"): v for k, v in LATTICE_SIZES.items()}
    assert (dflash["conv_kernel_size"], dflash["conv_group_size"]) == ((2, 16) if conv else (0, 0))
    spec, state = read_export(tmp_path / "l")
    assert spec == drafter.spec
    assert ("layers.0.attention_conv.base_kernel" in state) == conv
    assert {"lilicorr.layers.1.attn.in_proj_weight", "lilicorr.token_proj.weight", "lilicorr.feature_norm.bias",
            "lilicorr.feature_mlp.up_proj.bias", "lilicorr.slot_embedding"} <= set(state)
    loaded = load_drafter(tmp_path / "l")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    with pytest.raises(ConfigError, match="is a LiLiCorr drafter and this one is dflash.*drafter.variant=lilicorr"):
        init_from_export(tiny_drafter()[0], tmp_path / "l")
    other, _ = lilicorr(conv=not conv)
    with pytest.raises(ConfigError, match="do not match the LiLiCorrDraftModel export format"):
        init_from_export(other, tmp_path / "l")
    # a DFlash2 drafter starts a LiLiCorr one with convolutions: its backbone and convolutions, not its selector
    d2, _ = tiny_drafter(variant="dflash2", seed=5, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                         selector_top_k=4)
    export_drafter(d2, tmp_path / "d2", target_config=target)
    if conv:
        init_from_export(drafter, tmp_path / "d2")
        theirs = d2.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in drafter.state_dict().items() if not k.startswith("lilicorr."))
        assert torch.equal(drafter.state_dict()["lilicorr.in_head.weight"], loaded.state_dict()["lilicorr.in_head.weight"])
    else:
        with pytest.raises(ConfigError, match="has no convolutions: set drafter.lilicorr_conv=true"):
            init_from_export(drafter, tmp_path / "d2")
    del config["dflash_config"]["lilicorr_logit_scale"]
    (tmp_path / "l" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lacks \\['lilicorr_logit_scale'\\]"):
        read_export(tmp_path / "l")


@pytest.mark.parametrize("override, message", [
    (dict(lilicorr_candidate_topk=6), "power of two <= 16"),
    (dict(lilicorr_candidate_topk=32), "power of two <= 16"),
    (dict(lilicorr_num_heads=3), "lilicorr_num_heads=3 must divide the lattice head's width 32"),
    (dict(lilicorr_vector_eps=0.0), "lilicorr_vector_eps in \\(0, 0.5\\)"),
    (dict(lilicorr_w_ce=0.0, lilicorr_w_pen=0.0), "one > 0"),
    (dict(lilicorr_w_margin=0.1, lilicorr_margin=0.0), "lilicorr_margin > 0"),
    (dict(lilicorr_conv=True, conv_group_size=24), "conv_group_size=24 must divide the hidden size 64"),
])
def test_bad_lilicorr_settings_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        lilicorr(**override)


def test_lattice_spec_round_trips_its_export_fields():
    spec = LatticeSpec(hidden_size=0, candidate_topk=8, num_layers=2, num_heads=8, mlp_ratio=2.0, factor_dim=128,
                       vector_eps=1e-6, logit_scale=10.0)
    assert LatticeSpec.from_export(json.loads(json.dumps(spec.export_fields()))) == spec


def test_batched_decoding_equals_the_reference_loop_and_drafts_beyond_the_bonus():
    """`dflash-train eval`'s batched loop and the one-sequence reference loop walk the fitted drafter's lattice the
    same way (each anchored on its newest committed context), to the same outputs and acceptance lengths."""
    setup = fitted(variant="lilicorr")
    drafter, taps = setup.drafter, setup.drafter.spec.tap_layer_ids
    lengths = []
    for max_new in (26, 9):  # 9 ends inside a block
        results = decode_batch(setup.target, setup.prompts, proposer=batch_proposer_for(drafter, setup.target),
                               block_size=4, tap_layer_ids=taps, max_new_tokens=max_new, stop_token_ids=[])
        for prompt, result in zip(setup.prompts, results):
            ref = speculative_generate(setup.target, proposer_for(drafter, setup.target), prompt, block_size=4,
                                       tap_layer_ids=taps, max_new_tokens=max_new, stop_token_ids=[])
            assert (result.output_ids, result.acceptance_lengths) == (ref.output_ids, ref.acceptance_lengths)
            assert result.output_ids == target_generate(setup.target, prompt, max_new_tokens=max_new,
                                                        stop_token_ids=[]).output_ids  # lossless
            lengths += result.acceptance_lengths
    assert max(lengths) >= 3  # the fitted lattice drafts beyond the bonus token


def test_validation_walk_is_real_decodings():
    """The held-out walk (teacher-forced blocks, the lattice walk's picks) gives real decoding's acceptance."""
    decode_tests.test_walk_tau_equals_real_decoding_on_greedy_replies("lilicorr")


def test_sampled_drafts_carry_the_lattice_distribution_they_were_drawn_from():
    """At temperature > 0 each draft comes with its distribution over the K candidates (zero elsewhere), which the
    acceptance rule compares with the target's: decoding stays lossless, and commits every token asked for."""
    setup = fitted(variant="lilicorr")
    drafter, taps = setup.drafter, setup.drafter.spec.tap_layer_ids
    make = lambda: batch_proposer_for(drafter, setup.target)  # noqa: E731
    report = evaluate_tau(setup.target, make, setup.prompts[:2], block_size=4, max_new_tokens=10, tap_layer_ids=taps,
                          stop_token_ids=[], temperature=0.8, with_prompt_lookup=False, with_baseline=False)
    assert sum(k * c for k, c in enumerate(report.acceptance_histogram, 1)) == 20 - 2
    proposer = proposer_for(drafter, setup.target)
    prompt = setup.prompts[0]
    proposer.add_context(target_taps(setup.target, prompt, taps), torch.arange(prompt.shape[0]))
    draft = proposer.propose(int(prompt[-1]), prompt.shape[0], 4, 0.8, torch.Generator().manual_seed(0))
    probs = draft.probs  # (B-1, V)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert ((probs > 0).sum(-1) <= drafter.lilicorr.top_k).all()
    assert (probs.gather(-1, draft.tokens[:, None]) > 0).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eval_command_walks_a_lilicorr_export(temperature, tmp_path, capsys):
    """`dflash-train eval --drafter EXPORT` on a LiLiCorr export (convolutions on): it decodes with the lattice walk,
    losslessly (greedy: the target's own tokens), at a temperature too."""
    from dflash_trainer import cli

    drafter, target = lilicorr(conv=True)
    perturb(drafter)
    export = export_drafter(drafter, tmp_path / "export", target_config=target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                               for text in ("Count to ten.", "Name three colours.")))
    rc = cli.main(["eval", "--drafter", str(export), "--out", str(tmp_path / "out"), "target.random_init=tiny",
                   "target.tokenizer=tiny", "target.dtype=float32", "run.device=cpu", f"run.dir={tmp_path / 'run'}",
                   f"eval.prompts={prompts}", "eval.num_prompts=2", "eval.max_new_tokens=10", "data.max_length=64",
                   f"eval.temperature={temperature}"])
    assert rc == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["prompts"] == 2 and result["block_size"] == 4 and result["temperature"] == temperature
    committed = sum(k * c for k, c in enumerate(result["acceptance_histogram"], 1))
    assert result["tokens_generated"] == committed + 2 == 20
    assert result["greedy_match_rate"] == (1.0 if temperature == 0 else None)


def test_eval_without_the_lattice_head_drafts_the_backbones_top_1(tmp_path):
    """`eval.lattice_head=false` (what the head adds): the LiLiCorr drafter drafts each slot's top-1, exactly as the
    same backbone without a head, losslessly; a drafter without a lattice head refuses the setting."""
    from dflash_trainer.eval.proposers import DFlashBatchProposer

    setup = fitted(variant="lilicorr")
    drafter, taps = setup.drafter, setup.drafter.spec.tap_layer_ids
    embed, lm_head = setup.target.get_input_embeddings().weight, setup.target.lm_head.weight
    run = lambda proposer: decode_batch(setup.target, setup.prompts, proposer=proposer, block_size=4,  # noqa: E731
                                        tap_layer_ids=taps, max_new_tokens=26, stop_token_ids=[])
    no_head = run(DFlashBatchProposer(drafter, embed, lm_head, lattice_head=False))
    walked = run(batch_proposer_for(drafter, setup.target))
    head, drafter.lilicorr = drafter.lilicorr, None
    try:
        backbone = run(batch_proposer_for(drafter, setup.target))
    finally:
        drafter.lilicorr = head
    assert [r.acceptance_lengths for r in no_head] == [r.acceptance_lengths for r in backbone]
    assert [r.acceptance_lengths for r in no_head] != [r.acceptance_lengths for r in walked]  # the head drafts apart
    assert [r.output_ids for r in no_head] == [r.output_ids for r in walked]  # both lossless
    dflash, _ = tiny_drafter(variant="dflash")
    with pytest.raises(ConfigError, match="eval.lattice_head=false reads only a LiLiCorr"):
        DFlashBatchProposer(dflash, embed, lm_head, lattice_head=False)


def test_the_default_lattice_is_modelopts_published_recipe():
    """A LiLiCorr drafter from the defaults at Qwen3-8B's drafter width (4,096) exports the head geometry and trains
    the terms of ModelOpt's published `base` recipe (modelopt_recipes/general/speculative_decoding/lilicorr.yaml), the
    head its acceptance lengths were measured with; vector_eps and logit_scale change the scores, not a shape."""
    from dflash_trainer.drafter.spec import variant_fields

    drafter = DrafterConfig(variant="lilicorr")
    dflash = variant_fields(drafter, 4096)["lattice"].export_fields()
    assert dflash == {"lilicorr_enabled": True, "lilicorr_hidden_size": 1024, "lilicorr_candidate_topk": 8,
                      "lilicorr_num_layers": 2, "lilicorr_num_heads": 8, "lilicorr_mlp_ratio": 2.0,
                      "lilicorr_factor_dim": 1024, "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}
    assert (drafter.lilicorr_w_ce, drafter.lilicorr_w_margin, drafter.lilicorr_w_pen, drafter.lilicorr_margin) == \
        (0.25, 0.0, 0.25, 2.0)
