"""DFlash2 (`drafter.variant: dflash2`): its forward and selector against the reference package's
`DFlash2DraftModel` on our export, its start from a DFlash drafter, its training loss, and its export."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.dflash2 import BlockConv, previous_tokens, selector_targets, walk
from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter, read_export
from dflash_trainer.drafter.loss import SelectorLoss, drafter_loss
from dflash_trainer.errors import ConfigError
from tests.drafter_helpers import packed_batch, perturb_dflash2, single_thread, tiny_drafter  # noqa: F401

HAVE_DFLASH = importlib.util.find_spec("dflash") is not None
SIZES = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


def dflash2(seed: int = 0, **kw):
    return tiny_drafter(variant="dflash2", seed=seed, **{**SIZES, **kw})


def test_a_new_dflash2_computes_what_the_dflash_drafter_of_its_seed_computes(tmp_path):
    """Identity convolutions and a selector that adds nothing: the same hidden states, and greedy picks equal to
    the argmax. Started from a trained DFlash export (`drafter.init_from`), it computes that drafter's outputs."""
    base, _ = tiny_drafter(seed=3)
    new, target = dflash2(seed=3)
    shared = base.state_dict()
    assert all(torch.equal(new.state_dict()[k], v) for k, v in shared.items())  # the backbone draws as DFlash's
    with torch.no_grad():
        base.fc.weight.mul_(3.0)  # "trained": other weights than the seed's
    export_drafter(base, tmp_path / "dflash", target_config=target)
    init_from_export(new, tmp_path / "dflash")
    batch = packed_batch(base, num_blocks=8)
    with torch.no_grad():
        args = dict(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight)
        theirs, ours = base.forward_train(**args), new.forward_train(**args)  # (N, B, H)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
        head = torch.randn(new.spec.vocab_size, new.spec.hidden_size)
        logits = ours[:, 1:] @ head.T  # (N, B-1, V)
        walked = walk(new.candidate_selector, ours[:, 1:], logits, batch.plan.block_ids[:, 0], 0.0, None)
        assert torch.equal(walked.tokens, logits.argmax(-1))


def test_block_convolutions_stay_inside_each_block():
    """A block's output does not depend on another block's inputs, and slot k not on later slots (causal)."""
    conv = BlockConv(hidden_size=32, kernel_size=3, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 5, 32)  # two blocks of 5
    y, delta = conv.prepare(x)
    x2 = x.clone()
    x2[0] += 1.0  # change block 0 only
    x2[1, 3:] += 1.0  # and block 1's last two slots
    y2, _ = conv.prepare(x2)
    assert torch.equal(y[1, :3], y2[1, :3]) and not torch.equal(y[1, 3:], y2[1, 3:])
    # rows flattened as the training forward holds them give the same result
    flat, _ = conv.prepare(x.reshape(1, 10, 32).unflatten(1, (2, 5)))
    torch.testing.assert_close(flat[0], y)
    # the slow rule: y[k] = sum_t (base[t] + delta[k, t]) * x[k - t], groups sharing delta
    d = conv.kernel_projection(x).unflatten(-1, (2, 3, 4))[..., 0, :, :].repeat_interleave(8, dim=-1)  # (2, 5, 3, 32)
    want = torch.zeros_like(x)
    for k in range(5):
        for t in range(min(3, k + 1)):
            want[:, k] += (conv.base_kernel[0, t] + d[:, k, t]) * x[:, k - t]
    torch.testing.assert_close(y, want)


@pytest.mark.skipif(not HAVE_DFLASH, reason="the reference `dflash` package is not installed")
def test_reference_dflash2_loads_our_export_and_computes_our_forward_and_picks(tmp_path):
    from dflash.model import DFlash2DraftModel

    drafter, target = dflash2()
    perturb_dflash2(drafter)
    export_drafter(drafter, tmp_path, target_config=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in SIZES} == SIZES
    ref, info = DFlash2DraftModel.from_pretrained(str(tmp_path), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref.eval()
    batch = packed_batch(drafter, num_blocks=10)
    plan = batch.plan
    head = torch.nn.Linear(drafter.spec.hidden_size, drafter.spec.vocab_size, bias=False)
    checked = 0
    with torch.no_grad():
        train_out = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                          embed_weight=batch.embed_weight)
        for j in torch.nonzero(plan.block_valid).flatten().tolist():
            anchor, pos = int(plan.anchors[j]), int(plan.anchor_pos[j])
            if pos == 0:
                continue  # the reference needs at least one context token
            embeds = batch.embed_weight[plan.block_ids[j]]
            expected = ref(position_ids=torch.arange(pos + 4)[None], noise_embedding=embeds[None],
                           target_hidden=batch.taps[anchor - pos:anchor][None])  # (1, B, H)
            block = drafter.forward_block(block_embeds=embeds, block_positions=plan.positions[j],
                                          context_taps=batch.taps[anchor - pos:anchor], context_positions=torch.arange(pos))
            torch.testing.assert_close(block.hidden, expected[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(train_out[j], expected[0], atol=1e-5, rtol=1e-5)
            tokens, _, _ = ref.propose(expected[:, 1:], plan.block_ids[j, :1], head, 0.0)
            ours = walk(drafter.candidate_selector, block.hidden[None, 1:], head(block.hidden[None, 1:]),
                        plan.block_ids[j, :1], 0.0, None)
            assert torch.equal(ours.tokens, tokens)
            checked += 1
    assert checked >= 5


def test_sampled_walk_draws_from_the_selectors_distribution():
    drafter, _ = dflash2(selector_top_k=3)
    perturb_dflash2(drafter)
    selector = drafter.candidate_selector
    hidden = torch.randn(1, 2, drafter.spec.hidden_size).expand(4000, 2, -1)
    logits = torch.randn(1, 2, drafter.spec.vocab_size).expand(4000, 2, -1)
    first = torch.full((4000,), 7)
    with torch.no_grad():
        walked = walk(selector, hidden, logits, first, 1.0, torch.Generator().manual_seed(0))
        unary, candidates = logits[0].topk(3, dim=-1)
        q0 = torch.softmax(selector.scores(hidden[0, 0], unary[0], first[0], candidates[0]), -1)  # (3,)
    assert torch.allclose(walked.probs[0, 0].sum(), torch.tensor(1.0))
    torch.testing.assert_close(walked.probs[0, 0][candidates[0]], q0)
    assert walked.probs[0, 0].sum() == walked.probs[0, 0][candidates[0]].sum()  # zero off the candidates
    freq = torch.stack([(walked.tokens[:, 0] == c).float().mean() for c in candidates[0]])
    torch.testing.assert_close(freq, q0, atol=0.03, rtol=0)
    # slot 2's distribution follows slot 1's pick
    rows = walked.tokens[:, 0] == candidates[0, 0]
    assert torch.equal(walked.probs[rows, 1][0], walked.probs[rows, 1][-1])


def test_selector_targets_inject_or_ignore_a_missing_true_token():
    top = torch.tensor([[5, 6, 7], [5, 6, 7]])
    labels = torch.tensor([6, 9])
    inject = selector_targets(top, labels, "inject")
    assert inject.candidates.tolist() == [[5, 6, 7], [5, 6, 9]] and inject.target.tolist() == [1, 2]
    assert inject.contains.tolist() == [True, False] and inject.weight.tolist() == [1.0, 1.0]
    ignore = selector_targets(top, labels, "ignore")
    assert ignore.candidates.tolist() == [[5, 6, 7], [5, 6, 7]] and ignore.weight.tolist() == [1.0, 0.0]
    block_ids, block_labels = torch.tensor([[3, 1, 1, 1]]), torch.tensor([[0, 4, 8, 2]])
    assert previous_tokens(block_ids, block_labels).tolist() == [[3, 4, 8]]


def _loss(drafter, batch, hidden, **selector):
    loss = SelectorLoss(selector=drafter.candidate_selector, **{"weight": 1.0, "missing": "inject",
                                                                  "detach": False, **selector})
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    return drafter_loss(hidden, batch.plan, lm_head_weight=head, gamma=2.0, chunk_rows=7, selector=loss)


def test_selector_loss_trains_the_selector_and_its_gradient_can_stop_at_the_backbone():
    drafter, _ = dflash2()
    perturb_dflash2(drafter)
    batch = packed_batch(drafter, num_blocks=8)
    args = dict(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight)
    hidden = drafter.forward_train(**args)
    without = drafter_loss(hidden, batch.plan, lm_head_weight=torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size,
                                                                          generator=torch.Generator().manual_seed(2)),
                           gamma=2.0, chunk_rows=7)
    with_selector = _loss(drafter, batch, hidden)
    assert with_selector.loss_sum > without.loss_sum and torch.equal(with_selector.ce_sum, without.ce_sum)
    assert torch.equal(with_selector.weight_sum, without.weight_sum)  # the step normalises by the DFlash weights
    # the gradient of the selector term alone, through the backbone or stopped at it
    for detach in (False, True):
        drafter.zero_grad()
        hidden = drafter.forward_train(**args)
        (_loss(drafter, batch, hidden, detach=detach).loss_sum - _loss(drafter, batch, hidden, weight=0.0).loss_sum).backward()
        selector_grad = drafter.candidate_selector.successor_codebook.grad
        assert selector_grad is not None and selector_grad.abs().sum() > 0
        backbone = drafter.layers[0].mlp.down_proj.weight.grad
        assert (backbone is None or backbone.abs().sum() == 0) == detach


def test_selector_hits_are_the_greedy_walk_teacher_forced():
    """Slot accuracy and simulated tau count the selector's picks: at slot k with the true previous token, the
    selector's best candidate (decoding's greedy walk along an accepted prefix)."""
    drafter, _ = dflash2()
    perturb_dflash2(drafter, scale=3.0)  # a selector strong enough to overrule the argmax
    batch = packed_batch(drafter, num_blocks=8)
    head = torch.randn(drafter.spec.vocab_size, drafter.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    plan = batch.plan
    with torch.no_grad():
        hidden = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                       embed_weight=batch.embed_weight)
        out = _loss(drafter, batch, hidden)
        logits = hidden[:, 1:] @ head.T
        unary, candidates = logits.topk(drafter.spec.selector_top_k, dim=-1)
        previous = previous_tokens(plan.block_ids, plan.labels)
        scores = drafter.candidate_selector.scores(hidden[:, 1:], unary, previous, candidates)
        picks = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]  # (N, B-1)
    hits = (picks == plan.labels[:, 1:]) & plan.label_valid[:, 1:]
    assert torch.equal(out.slot_correct, hits.float().sum(0))
    assert not torch.equal(picks, logits.argmax(-1))  # the selector changed some picks


def test_dflash2_export_round_trip_and_warm_start_rules(tmp_path):
    drafter, target = dflash2()
    perturb_dflash2(drafter)
    export_drafter(drafter, tmp_path / "d2", target_config=target)
    spec, state = read_export(tmp_path / "d2")
    assert spec == drafter.spec
    assert "candidate_selector.predecessor_codebook" in state and "layers.1.mlp_conv.base_kernel" in state
    loaded = load_drafter(tmp_path / "d2")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    base, _ = tiny_drafter()
    with pytest.raises(ConfigError, match="is a DFlash2 drafter and this one is dflash: .*drafter.variant=dflash2"):
        init_from_export(base, tmp_path / "d2")
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    del config["dflash_config"]["selector_rank"]
    (tmp_path / "d2" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lacks \\['selector_rank'\\]"):
        read_export(tmp_path / "d2")


@pytest.mark.parametrize("override, message", [
    (dict(variant="dflash3"), "drafter.variant must be one of dflash, dflash2"),
    (dict(selector_missing="drop"), "selector_missing must be inject or ignore"),
    (dict(conv_kernel_size=9, block_size=8), "reaches past a block"),
    (dict(selector_top_k=0), "selector_top_k must be >= 1"),
])
def test_bad_dflash2_settings_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        DrafterConfig(**{"variant": "dflash2", **override})


def test_a_group_size_that_does_not_divide_the_hidden_size_is_refused():
    with pytest.raises(ConfigError, match="conv_group_size=24 must divide the hidden size 64"):
        dflash2(conv_group_size=24)


def test_speculators_export_of_a_dflash2_drafter(tmp_path):
    """speculators 0.9's `dflash2` type: its sizes at the top level, where speculators and vLLM's `update_dflash2`
    read them; vLLM serves it under the `dflash` method."""
    from dflash_trainer.drafter.export_speculators import export_speculators

    drafter, target = dflash2()
    target.architectures = ["Qwen3ForCausalLM"]
    target.save_pretrained(tmp_path / "verifier")
    export_speculators(drafter, tmp_path / "spec", verifier=str(tmp_path / "verifier"), target_config=target)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert config["speculators_config"]["algorithm"] == "dflash2"
    assert {k: config[k] for k in SIZES} == SIZES and config["sliding_window_non_causal"] is True


def test_init_from_a_dflash_training_checkpoint_starts_dflash2_there(tmp_path):
    """`drafter.init_from: RUN/checkpoints/step_N` (a DFlash run's): the DFlash weights (the weight average where
    the run kept one), the taps checked against the checkpoint's."""
    from dflash_trainer.config import load_config
    from dflash_trainer.train.checkpoint import CheckpointState, save_checkpoint
    from dflash_trainer.train.trainer import build_drafter, model_signature

    base, target = tiny_drafter(seed=4)
    state = CheckpointState(step=3, epoch=0, ledger={}, model_signature=model_signature(base.spec),
                            data_fingerprint="", scheduler={}, extra={})
    averaged = {f"ema.{k}": v + 1.0 for k, v in base.state_dict().items()}
    ckpt = save_checkpoint(tmp_path / "run", state, base.state_dict() | averaged, {}, keep_last=1)
    config = load_config("demo", [f"drafter.init_from={ckpt}", "drafter.variant=dflash2", "drafter.block_size=4", "drafter.gamma=2",
                                  "drafter.conv_group_size=16", "drafter.selector_rank=8", "drafter.selector_top_k=5"])
    new_spec = dflash2()[0].spec
    model = build_drafter(config, new_spec, torch.device("cpu"))
    own = model.state_dict()
    assert all(torch.equal(own[k], v + 1.0) for k, v in base.state_dict().items())  # the average, as export takes
    assert torch.equal(own["layers.0.mlp_conv.base_kernel"][:, 0], torch.ones_like(own["layers.0.mlp_conv.base_kernel"][:, 0]))
    other = tiny_drafter(variant="dflash2", tap_layer_ids=[2, 4], **SIZES)[0].spec
    with pytest.raises(ConfigError, match="taps layers \\[1, 3\\] but this drafter taps \\[2, 4\\]"):
        build_drafter(config, other, torch.device("cpu"))
