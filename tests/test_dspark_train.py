"""Training a DSpark drafter (`drafter.variant: dspark`): its blocks' labels one position further on, its loss against
a slow reference written from the paper's definition, a CPU training step that learns, and the options it refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.config import load_config
from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.dspark import MarkovLoss, markov_loss
from dflash_trainer.drafter.loss import Teacher, drafter_loss
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.head import TargetHead
from dflash_trainer.train.micro_step import make_micro_step
from dflash_trainer.transport.wire import HiddenStateBatch
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)

RANK = 8


def dspark(block_size: int = 4, seed: int = 0, **kw):
    return tiny_drafter(variant="dspark", block_size=block_size, seed=seed, markov_rank=RANK, **kw)


def dspark_plan(drafter, batch, label_offset: int = 1, block_size=None, num_blocks: int = 10):
    return plan_blocks(input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                       num_blocks=num_blocks, block_size=block_size or drafter.spec.block_size,
                       mask_token_id=drafter.spec.mask_token_id, seed=0, epoch=0, job_id=0, label_offset=label_offset)


@torch.no_grad()
def perturb_markov(drafter, scale: float = 1.0, seed: int = 5) -> None:
    """A Markov head strong enough to change picks (the initial one, std 0.02, rarely does)."""
    gen = torch.Generator().manual_seed(seed)
    for p in drafter.markov_head.parameters():
        p.copy_(scale * torch.randn(p.shape, generator=gen))


def test_a_dspark_spec_and_its_blocks_label_one_position_further_on():
    drafter, _ = dspark()
    spec = drafter.spec
    assert spec.variant == "dspark" and spec.markov_rank == RANK and spec.draft_length == 4 and spec.label_offset == 1
    assert dict(drafter.named_parameters())["markov_head.markov_w1.weight"].shape == (spec.vocab_size, RANK)
    batch = packed_batch(drafter)
    ours = dspark_plan(drafter, batch)
    # a DFlash plan one slot longer from the same anchors: its slots 1..B are our slots 0..B-1
    wider = dspark_plan(drafter, batch, label_offset=0, block_size=spec.block_size + 1)
    assert torch.equal(ours.anchors, wider.anchors) and ours.block_valid.sum() > 5
    assert torch.equal(ours.labels, wider.labels[:, 1:]) and torch.equal(ours.label_valid, wider.label_valid[:, 1:])
    assert torch.equal(ours.label_valid[:, 0], ours.block_valid)  # the anchor rule holds every block's first label
    assert torch.equal(ours.block_ids, wider.block_ids[:, :-1]) and torch.equal(ours.positions, wider.positions[:, :-1])
    for n in torch.nonzero(ours.block_valid).flatten().tolist():
        a = int(ours.anchors[n])
        assert ours.labels[n, 0] == batch.input_ids[a + 1] and ours.block_ids[n, 0] == batch.input_ids[a]


def reference_loss(hidden, plan, head, w1, w2, gamma, kd_weight=0.0, teacher=None, divergence="l1", dpace=False,
                   alpha=0.5):
    """The DSpark loss block by block and slot by slot, from the definition: slot k's logits are U_k + W2 W1[x],
    x the true token before the slot (the anchor's for slot 0); its label the token at anchor + k + 1; rows after
    the first unlabelled slot left out; weights exp(-k/gamma) (or D-PACE's); the target's distribution for slot k
    the one at anchor + k."""
    loss = weight = ce_total = torch.zeros(())
    accept = torch.zeros(())
    n, b, _ = hidden.shape
    correct, count = torch.zeros(b), torch.zeros(b)
    for i in range(n):
        if not plan.block_valid[i]:
            continue
        rows, leading, q_prefix = [], True, 1.0
        for k in range(b):
            if not plan.label_valid[i, k]:
                break
            prev = plan.block_ids[i, 0] if k == 0 else plan.labels[i, k - 1]
            logits = hidden[i, k] @ head.T + w2 @ w1[prev]
            logp = torch.log_softmax(logits, -1)
            ce = -logp[plan.labels[i, k]]
            row = ce
            if kd_weight:
                t = torch.softmax(teacher.final_norm(teacher.last_hidden[plan.anchors[i] + k]) @ head.T, -1)
                if divergence == "l1":
                    dist = (logp.exp() - t).abs().sum()
                else:
                    dist = (t * (t.log() - logp)).sum()
                row = (1 - kd_weight) * ce + kd_weight * dist
            hit = bool(logits.argmax() == plan.labels[i, k])
            correct[k] += hit
            count[k] += 1
            leading = leading and hit
            accept = accept + leading
            rows.append((k, ce, row))
        accept = accept + 1
        # D-PACE's q~ over all B slots, q = 0 past the labelled prefix (loss.py's definition)
        q = [(1 - alpha) * (torch.exp(-rows[m][1].detach()) if m < len(rows) else 0.0) + alpha for m in range(b)]
        for k, ce, row in rows:
            if dpace:  # sum over m >= k of prod_{i <= m} q~_i
                w = sum(torch.prod(torch.tensor([float(x) for x in q[: m + 1]])) for m in range(k, b))
            else:
                w = torch.exp(torch.tensor(-k / gamma))
            loss, weight, ce_total = loss + w * row, weight + w, ce_total + w * ce
    return loss, weight, ce_total, correct, count, accept


CASES = {
    "CE with decay": dict(),
    "DSpark's 0.1 CE + 0.9 L1": dict(kd_weight=0.9, divergence="l1"),
    "CE + KL": dict(kd_weight=0.5, divergence="kl"),
    "D-PACE": dict(dpace=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dspark_loss_and_gradients_equal_the_slow_reference(case):
    kw = CASES[case]
    drafter, _ = dspark()
    perturb_markov(drafter, scale=0.5)
    batch = packed_batch(drafter, seqlens=(15, 18, 4))
    plan = dspark_plan(drafter, batch)
    assert (~plan.label_valid[:, 1:] & plan.label_valid[:, :-1]).any()  # some block runs past a sequence's end
    gen = torch.Generator().manual_seed(2)
    spec = drafter.spec
    head = torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.3
    teacher = Teacher(last_hidden=torch.randn(batch.input_ids.shape[0], spec.hidden_size, generator=gen),
                      final_norm=torch.nn.RMSNorm(spec.hidden_size))
    hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                   embed_weight=batch.embed_weight)
    out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=5, kd_weight=kw.get("kd_weight", 0.0),
                       teacher=teacher, dpace=kw.get("dpace", False),
                       markov=markov_loss(drafter, kw.get("divergence", "l1")))
    ours = torch.autograd.grad(out.loss_sum, [hidden, *drafter.markov_head.parameters()], retain_graph=True)
    ref = reference_loss(hidden, plan, head, drafter.markov_w1.weight, drafter.markov_w2.weight, 2.0,
                         kd_weight=kw.get("kd_weight", 0.0), teacher=teacher, divergence=kw.get("divergence", "l1"),
                         dpace=kw.get("dpace", False))
    theirs = torch.autograd.grad(ref[0], [hidden, *drafter.markov_head.parameters()])
    for name, a, b in zip(("loss", "weight", "ce"), (out.loss_sum, out.weight_sum, out.ce_sum), ref[:3]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=name)
    assert torch.equal(out.slot_correct, ref[3]) and torch.equal(out.slot_count, ref[4])
    assert out.accept_sum == ref[5] and out.block_count == plan.block_valid.sum()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert ours[1].abs().sum() > 0 and ours[2].abs().sum() > 0  # the Markov head learns


def check_compiled_chunks(case: str, device: str, backend: str, tol: float) -> None:
    """DSpark's loss with its chunks compiled by `backend` on `device` gives eager's sums, hits and gradients (the
    hidden rows' and the Markov factors'), chunked under activation checkpointing as training runs it."""
    kw = CASES[case]
    drafter, _ = dspark()
    perturb_markov(drafter, scale=0.5)
    batch = packed_batch(drafter, seqlens=(15, 18, 4))
    plan = dspark_plan(drafter, batch)
    plan = dataclasses.replace(plan, **{f.name: getattr(plan, f.name).to(device) for f in dataclasses.fields(plan)})
    gen = torch.Generator().manual_seed(3)
    spec = drafter.spec
    head = (torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.3).to(device)
    teacher = Teacher(last_hidden=torch.randn(batch.input_ids.shape[0], spec.hidden_size, generator=gen).to(device),
                      final_norm=torch.nn.RMSNorm(spec.hidden_size).to(device))
    rows = torch.randn(plan.num_blocks, plan.block_size, spec.hidden_size, generator=gen)  # (N, B, H)
    markov = drafter.markov_head.to(device)
    eager = markov_loss(drafter, kw.get("divergence", "l1")).chunk_kernel
    kernels = {"eager": eager, backend: torch.compile(eager, backend=backend, fullgraph=True, dynamic=False)}
    results = {}
    for name, kernel in kernels.items():
        hidden = rows.to(device).requires_grad_(True)
        loss = MarkovLoss(head=markov, divergence=kw.get("divergence", "l1"), chunk_kernel=kernel)
        out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=7,
                           kd_weight=kw.get("kd_weight", 0.0), teacher=teacher, dpace=kw.get("dpace", False),
                           markov=loss)
        grads = torch.autograd.grad(out.loss_sum, [hidden, *markov.parameters()])
        results[name] = (out, grads)
    (eager, eager_grads), (traced, traced_grads) = results["eager"], results[backend]
    assert plan.num_blocks * plan.block_size % 7 != 0  # chunks of two sizes
    for field in ("loss_sum", "weight_sum", "ce_sum", "accept_sum"):
        torch.testing.assert_close(getattr(traced, field), getattr(eager, field), atol=tol, rtol=tol, msg=field)
    assert torch.equal(traced.slot_correct, eager.slot_correct)
    for want, got in zip(eager_grads, traced_grads):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert all(g.abs().sum() > 0 for g in eager_grads)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dspark_loss_chunks_traced_and_compiled_give_eagers_values(case):
    """The graph torch.compile builds of a chunk (AOTAutograd's forward and backward, run eagerly here: Inductor's
    kernels are checked on CUDA, tests/test_dspark_gpu.py) computes what eager computes."""
    check_compiled_chunks(case, "cpu", "aot_eager", tol=1e-5)


def test_dspark_loss_chunks_compile_on_cuda_only():
    """`drafter.loss_kernel: compiled` compiles the chunks where training is fast (CUDA); a CPU run stays eager, as
    the CE kernel does (a compile there costs more than it saves)."""
    drafter, _ = dspark()
    assert markov_loss(drafter, "l1", compiled=True).chunk_kernel is markov_loss(drafter, "l1").chunk_kernel


def test_dspark_hits_are_the_markov_walk_teacher_forced():
    """Slot accuracy counts the walk's greedy pick with the true previous token, and the bias changes picks."""
    drafter, _ = dspark()
    perturb_markov(drafter, scale=3.0)
    batch = packed_batch(drafter)
    plan = dspark_plan(drafter, batch)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                       embed_weight=batch.embed_weight)
        out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=64,
                           markov=markov_loss(drafter, "l1"))
        base = hidden @ head.T  # (N, B, V)
        previous = torch.cat([plan.block_ids[:, :1], plan.labels[:, :-1]], 1)
        picks = (base + F.embedding(previous, drafter.markov_w1.weight) @ drafter.markov_w2.weight.T).argmax(-1)
    valid = torch.cumprod(plan.label_valid.long(), 1).bool()
    assert torch.equal(out.slot_correct, ((picks == plan.labels) & valid).float().sum(0))
    assert not torch.equal(picks, base.argmax(-1))


def _config(*overrides):
    return load_config(None, ["target.random_init=tiny", "run.device=cpu", "train.dtype=float32",
                              "pipeline.token_budget=48", "drafter.num_blocks=10", "drafter.variant=dspark",
                              f"drafter.markov_rank={RANK}", "drafter.block_size=4", "drafter.gamma=2", *overrides])


@pytest.mark.parametrize("kd", [False, True])
def test_a_dspark_drafter_trains_on_the_cpu(kd):
    """The trainer's own micro step (chunked too, one block a chunk: the same sums) on one batch, AdamW: the loss
    falls and the Markov head moves."""
    drafter, _ = dspark()
    spec = drafter.spec
    gen = torch.Generator().manual_seed(11)
    head = TargetHead(embed_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
                      lm_head_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.1,
                      final_norm=torch.nn.RMSNorm(spec.hidden_size))
    helper = packed_batch(drafter, seqlens=(20, 22), num_slots=48, seed=3)
    batch = HiddenStateBatch(job_id=7, bucket_id=0, epoch=0, num_tokens=42, num_seqs=2, cu_seqlens=helper.cu_seqlens,
                             input_ids=helper.input_ids, loss_mask=helper.loss_mask, taps=helper.taps,
                             last_hidden=torch.randn(48, spec.hidden_size, generator=gen) if kd else None)
    kd_options = ["drafter.kd_weight=0.9"] if kd else []
    step = make_micro_step(_config(*kd_options), drafter, head, device=torch.device("cpu"), progress=lambda: 0.0)
    chunked = make_micro_step(_config("train.blocks_per_chunk=1", *kd_options), drafter, head,
                              device=torch.device("cpu"), progress=lambda: 0.0)
    drafter.zero_grad()
    one = step(batch)
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    many = chunked(batch)
    torch.testing.assert_close(many.loss_sum, one.loss_sum)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)
    assert one.slot_count.shape == (4,) and one.slot_count[0] == one.num_blocks  # every slot drafts, slot 0 too
    w2 = drafter.markov_w2.weight.detach().clone()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        out = step(batch)
        losses.append(float(out.loss_sum / out.weight_sum))
        opt.step()
    assert losses[-1] < 0.7 * losses[0]
    assert not torch.equal(drafter.markov_w2.weight, w2)


@pytest.mark.parametrize("variant, option, named", [
    ("dspark", {"selector_top_k": 4}, "drafter.selector_top_k is a dflash2 option, which drafter.variant=dspark "
                                      "ignores"),
    ("dspark", {"conv_kernel_size": 3, "selector_weight": 0.5}, "drafter.conv_kernel_size, drafter.selector_weight "
                                                                "are dflash2 options, which drafter.variant=dspark"),
    ("dflash", {"markov_rank": 64}, "drafter.markov_rank is a dspark option, which drafter.variant=dflash ignores: "
                                    "remove it or set drafter.variant=dspark"),
    ("dflash2", {"dspark_divergence": "kl"}, "drafter.dspark_divergence is a dspark option, which "
                                             "drafter.variant=dflash2"),
    ("dspark", {"markov_rank": 0}, "drafter.markov_rank must be >= 1"),
    ("dspark", {"dspark_divergence": "tv"}, "drafter.dspark_divergence must be one of l1, kl"),
])
def test_options_the_variant_ignores_are_refused(variant, option, named):
    with pytest.raises(ConfigError, match=named):
        DrafterConfig(variant=variant, **option)


def test_dspark_and_dflash_options_with_their_own_variant_are_taken():
    assert DrafterConfig(variant="dspark", markov_rank=64, dspark_divergence="kl").markov_rank == 64
    assert DrafterConfig(variant="dflash2", selector_top_k=4).selector_top_k == 4
    assert dataclasses.replace(DrafterConfig(), block_size=8).variant == "dflash"


def test_modelopt_names_read_and_a_dspark_export_starts_a_dspark_drafter(tmp_path):
    """ModelOpt's export of the same drafter (flat `markov_w1.weight`, `architectures: DFlashDraftModel`) reads as
    ours does; `drafter.init_from` a DSpark export starts a DSpark drafter with all its weights, Markov head too."""
    from safetensors.torch import load_file, save_file

    from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter

    drafter, _ = dspark()
    perturb_markov(drafter)
    out = export_drafter(drafter, tmp_path / "ours")
    state = load_file(str(out / "model.safetensors"))
    flat = {k.removeprefix("markov_head."): v for k, v in state.items()}
    assert set(flat) - set(state) == {"markov_w1.weight", "markov_w2.weight"}
    save_file(flat, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    for key in ("markov_rank", "markov_head_type", "sample_from_anchor", "enable_confidence_head"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config | {"architectures": ["DFlashDraftModel"]}))
    loaded = load_drafter(out)
    assert loaded.spec == drafter.spec
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    fresh, _ = dspark(seed=9)
    init_from_export(fresh, out)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), drafter.state_dict().values()))


@pytest.mark.parametrize("variant, option, named", [
    ("dflash", {"selector_top_k": 8}, "drafter.selector_top_k is a dflash2 option, which drafter.variant=dflash "
                                      "ignores: remove it or set drafter.variant=dflash2"),
    ("dflash", {"conv_group_size": 32}, "drafter.conv_group_size is a dflash2 option, which drafter.variant=dflash"),
    ("lilicorr", {"conv_kernel_size": 3}, "which drafter.variant=lilicorr ignores: remove it or set "
                                          "drafter.lilicorr_conv=true or set drafter.variant=dflash2"),
    ("lilicorr", {"selector_rank": 64}, "drafter.selector_rank is a dflash2 option, which drafter.variant=lilicorr"),
    ("dflash2", {"lilicorr_candidate_topk": 4}, "drafter.lilicorr_candidate_topk is a lilicorr option"),
    ("dspark", {"lilicorr_conv": True}, "drafter.lilicorr_conv is a lilicorr option, which drafter.variant=dspark"),
])
def test_every_variants_options_are_refused_by_the_others(variant, option, named):
    """A setting only another variant reads is an error naming that variant (DFlash2's on a DFlash drafter trained a
    plain DFlash drafter without a word); LiLiCorr reads the convolution sizes only with its convolutions on."""
    with pytest.raises(ConfigError, match=named):
        DrafterConfig(variant=variant, **option)
    assert DrafterConfig(variant="lilicorr", lilicorr_conv=True, conv_kernel_size=3).conv_kernel_size == 3
    assert DrafterConfig(variant="lilicorr", lilicorr_candidate_topk=4).lilicorr_candidate_topk == 4
