"""The serving check's pure parts, in the main suite (the check itself runs in .serving-venv with the engines:
bash scripts/serving-check.sh). Its one substitution, SDPA over [context, block] given a layer's causal flag and
window (scripts/serving_check/attention.py), must compute our drafter's forward when given the flags we train with,
and another forward when given others; the judge must pass, fail and excuse the rows it should."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from serving_check.attention import attend, visible  # noqa: E402
from serving_check.cases import SHAPES, BLOCK_SIZE, make_inputs, randomize, reference_of  # noqa: E402
from serving_check.jobs import EngineResult, Job  # noqa: E402
from serving_check.report import FAIL, NOT_READ, PASS, REFUSED, judge  # noqa: E402
from serving_check.variants import DFLASH  # noqa: E402

from dflash_trainer.drafter.model import _rope  # noqa: E402
from tests.drafter_helpers import single_thread  # noqa: E402,F401 (autouse fixture)


def test_window_rule_is_the_kernels():
    q, k = torch.tensor([5]), torch.arange(8)
    assert visible(q, k, causal=True, window_left=2)[0].tolist() == [k in (3, 4, 5) for k in range(8)]
    assert visible(q, k, causal=False, window_left=2)[0].tolist() == [3 <= k <= 7 for k in range(8)]
    assert visible(q, k, causal=False, window_left=None).all()


def _forward_with_attend(drafter, inputs, embed, *, flip_causal=False):
    """Our drafter's layers with `attend` as their attention kernel, given the flags we train with (an engine's
    layer, when it resolves our config right)."""
    spec, (cpos, bpos) = drafter.spec, (inputs["context_positions"], inputs["block_positions"])
    context = drafter.context(inputs["taps"])  # (C, H)
    rope_ctx, rope_blk = drafter.rotary(cpos, context.dtype), drafter.rotary(bpos, context.dtype)
    h = embed[inputs["block_ids"]]  # (B, H)
    for i, layer in enumerate(drafter.layers):
        a, window = layer.self_attn, spec.layer_window(i)
        ctx_k, ctx_v = a.kv(context, rope_ctx)  # (C, nkv, hd)
        x = layer.input_layernorm(h)
        q = _rope(a.q_norm(a.q_proj(x).unflatten(-1, (a.num_heads, a.head_dim))), rope_blk)
        k, v = a.kv(x, rope_blk)
        out = attend(q.flatten(-2), k.flatten(-2), v.flatten(-2), context_k=ctx_k, context_v=ctx_v, q_pos=bpos,
                     context_pos=cpos, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                     scale=a.head_dim ** -0.5, causal=(window is not None) != flip_causal,
                     window_left=None if window is None else window - 1)
        h = h + a.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_attend_with_our_flags_is_our_forward(shape, tiny_target_config):
    drafter = DFLASH.build(shape, BLOCK_SIZE, tiny_target_config)
    randomize(drafter, seed=1)
    inputs = make_inputs(drafter.spec, seed=2)
    embed = torch.randn(tiny_target_config.vocab_size, tiny_target_config.hidden_size)
    with torch.no_grad():
        ours = DFLASH.reference(drafter, inputs, embed)
        theirs = _forward_with_attend(drafter, inputs, embed)
        flipped = _forward_with_attend(drafter, inputs, embed, flip_causal=True)
    diff = (theirs - ours).abs().max().item()
    print(f"{shape.name}: attend with our flags vs our forward_block: max |diff| {diff:.1e}")
    assert diff < 1e-5
    assert (flipped - ours).abs().max().item() > 1e-2  # the check sees a wrong causality


def _job(**kw):
    base = dict(id="all-full/dflash", variant="dflash", drafter="all-full", format="dflash", export="E", target="T",
                inputs="I", block_size=BLOCK_SIZE)
    return Job(**{**base, **kw})


def test_judge(tmp_path, tiny_target_config):
    drafter = DFLASH.build(SHAPES[0], BLOCK_SIZE, tiny_target_config)
    hidden, head = torch.randn(BLOCK_SIZE, 64), torch.randn(100, 64)
    ref = reference_of(drafter, hidden)
    out = tmp_path / "out.pt"
    torch.save({"hidden": hidden + 1e-6, "logits": (hidden @ head.T)}, out)
    ran = dict(job="all-full/dflash", engine="vllm", status="ran", model_class="DFlashQwen3ForCausalLM",
               layers=ref.layers, taps=ref.taps, block_size=BLOCK_SIZE, outputs=str(out))
    classes = DFLASH.engine_classes
    assert judge("vllm", _job(), EngineResult(**ran), ref, head, classes).result == PASS
    causal = [{"causal": True, "window": None}] * len(ref.layers)
    row = judge("vllm", _job(), EngineResult(**{**ran, "layers": causal}), ref, head, classes)
    assert row.result == FAIL and "layers C C C, trained N N N" in row.why
    torch.save({"hidden": hidden + 1e-3, "logits": hidden @ head.T}, out)
    assert judge("vllm", _job(), EngineResult(**ran), ref, head, classes).result == FAIL
    not_read = dict(job="x", status="not-read", detail="no model_type")
    spec_job = _job(format="speculators")
    assert judge("sglang", spec_job, EngineResult(engine="sglang", **not_read), ref, head, classes).result \
        == NOT_READ
    assert judge("vllm", spec_job, EngineResult(engine="vllm", **not_read), ref, head, classes).result == FAIL
    assert judge("vllm", _job(refused="cannot describe"), None, ref, head, classes).result == REFUSED
    assert judge("vllm", _job(), None, ref, head, classes).result == FAIL  # the engine's process died



def test_dflash2_lattice_is_what_decoding_walks(tiny_target_config):
    """The DFlash2 selector scores the check compares (a lattice over the previous slot's candidates, as both
    engines compute it) give the picks of our decoding's greedy walk."""
    from serving_check.variants import DFLASH2

    from dflash_trainer.drafter.dflash2 import walk

    drafter = DFLASH2.build(SHAPES[0], BLOCK_SIZE, tiny_target_config)
    randomize(drafter, seed=3)
    hidden, head = torch.randn(BLOCK_SIZE, 64), torch.randn(tiny_target_config.vocab_size, 64)
    ours = DFLASH2.selector(drafter, hidden, head, 7)
    picks, prev = [], 0
    for e, (scores, candidates) in enumerate(zip(ours["lattice"], ours["candidates"])):
        prev = int(scores[prev if e else 0].argmax())  # slot 1's predecessor is the block's first token
        picks.append(int(candidates[prev]))
    with torch.no_grad():
        walked = walk(drafter.candidate_selector, hidden[None, 1:], (hidden[1:] @ head.T)[None], torch.tensor([7]),
                      0.0, None)
    assert walked.tokens[0].tolist() == picks


def test_dspark_walk_is_the_markov_walk_and_the_judge_holds_engines_to_it(tmp_path, tiny_target_config):
    """The DSpark walk the check compares: each slot's scores are its logits plus W2 W1[the previous pick] (the
    anchor for slot 0), the drafts their argmaxes, and the (randomized) Markov head changes picks. The judge fails an
    engine whose drafts or scores differ (a head left out, as an engine that loads the backbone only would run)."""
    from serving_check.variants import DSPARK

    drafter = DSPARK.build(SHAPES[0], BLOCK_SIZE, tiny_target_config)
    randomize(drafter, seed=3)
    hidden, head = torch.randn(BLOCK_SIZE, 64), torch.randn(tiny_target_config.vocab_size, 64) * 0.1
    ours = DSPARK.walk(drafter, hidden, head, 7)
    prev = 7
    for k in range(BLOCK_SIZE):
        with torch.no_grad():
            scores = hidden[k] @ head.T + drafter.markov_w2.weight @ drafter.markov_w1.weight[prev]
        torch.testing.assert_close(ours["scores"][k], scores)
        prev = int(scores.argmax())
        assert int(ours["drafts"][k]) == prev
    unbiased = (hidden @ head.T).argmax(-1)
    assert not torch.equal(ours["drafts"], unbiased)

    ref = reference_of(drafter, hidden, walk=ours)
    out = tmp_path / "out.pt"
    ran = dict(job="dspark/all-full/dflash", engine="vllm", status="ran", model_class="Qwen3DSparkForCausalLM",
               layers=ref.layers, taps=ref.taps, block_size=BLOCK_SIZE, outputs=str(out))
    job = _job(variant="dspark")
    for drafts, scores, result in [(ours["drafts"], ours["scores"], PASS),
                                   (unbiased, hidden @ head.T, FAIL),
                                   (ours["drafts"], ours["scores"] + 1e-3, FAIL)]:
        torch.save({"hidden": hidden, "logits": hidden @ head.T, "drafts": drafts, "scores": scores}, out)
        row = judge("vllm", job, EngineResult(**ran), ref, head, DSPARK.engine_classes)
        assert row.result == result, row.why
    torch.save({"hidden": hidden, "logits": hidden @ head.T}, out)
    assert judge("vllm", job, EngineResult(**ran), ref, head, DSPARK.engine_classes).why == "no Markov walk output"


@pytest.mark.parametrize("name", ["lilicorr", "lilicorr-conv"])
def test_lilicorr_lattice_is_what_decoding_walks_and_the_judge_checks_the_picks(name, tmp_path, tiny_target_config):
    """The LiLiCorr scores the check compares (slot s's row p: after the previous slot's candidate p; slot 0's rows the
    anchor's) give our walk's picks when walked as the engines walk them; a row whose picks differ fails."""
    from serving_check.cases import Target
    from serving_check.variants import VARIANTS

    variant = VARIANTS[name]
    drafter = variant.build(SHAPES[0], BLOCK_SIZE, tiny_target_config)
    randomize(drafter, seed=3)
    inputs = make_inputs(drafter.spec, seed=4)
    v, h = tiny_target_config.vocab_size, tiny_target_config.hidden_size
    target = Target(path="T", embed=torch.randn(v, h), head=torch.randn(v, h))
    with torch.no_grad():
        hidden = variant.reference(drafter, inputs, target.embed)
        ours = variant.lattice(drafter, hidden, inputs, target)
    previous, picks = 0, []
    for scores, candidates in zip(ours["lattice"], ours["candidates"]):
        previous = int(scores[previous].argmax())
        picks.append(int(candidates[previous]))
    assert ours["picks"].tolist() == picks
    assert len(set(picks)) > 1 and not torch.equal(ours["lattice"][1], ours["lattice"][1][:1].expand_as(ours["lattice"][1]))
    ref = reference_of(drafter, hidden, ours)
    out = tmp_path / "out.pt"
    ran = dict(job="j", engine="sglang", status="ran", model_class="LiLiCorrDraftModel", layers=ref.layers,
               taps=ref.taps, block_size=BLOCK_SIZE, outputs=str(out))
    job = _job(variant=name)
    torch.save({"hidden": hidden, "logits": hidden @ target.head.T, **ours}, out)
    assert judge("sglang", job, EngineResult(**ran), ref, target.head, variant.engine_classes).result == PASS
    torch.save({"hidden": hidden, "logits": hidden @ target.head.T, **ours, "picks": ours["picks"].flip(0)}, out)
    row = judge("sglang", job, EngineResult(**ran), ref, target.head, variant.engine_classes)
    assert row.result == FAIL and "picks differ" in row.why
