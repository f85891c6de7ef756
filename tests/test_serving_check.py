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

from dflash_trainer.data.tiny_tokenizer import TINY_VISION_TOKENS  # noqa: E402
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


IMAGE_PAD = TINY_VISION_TOKENS["<|image_pad|>"]


@pytest.fixture(scope="module")
def image_case(tmp_path_factory):
    from serving_check.image_case import build_image_jobs

    work = tmp_path_factory.mktemp("image-case")
    return build_image_jobs(work, formats=("dflash",))


def test_image_case_feeds_the_engines_positions_which_give_the_training_forward(image_case):
    """The image case's block: the engines' positions (context 0..C-1 after a prompt holding an image, block
    C..C+B-1) give our training forward of the block anchored there; the M-RoPE positions of the target (what vLLM's V1
    runner hands the drafter: their first row) give another forward, so the check sees positions."""
    from dflash_trainer.drafter.export import load_drafter
    from serving_check.cases import read_target

    (job,), references, target = image_case
    reference, inputs = references[job.id], torch.load(job.inputs)
    conversation = torch.load(job.conversation)
    drafter = load_drafter(job.export, attention="sdpa").float()
    c = len(inputs["context_positions"])
    ids = conversation["input_ids"]
    image = torch.nonzero(ids == IMAGE_PAD).flatten()
    assert len(image) == 12 and image[-1] < c and torch.equal(inputs["block_positions"], c + torch.arange(BLOCK_SIZE))
    assert torch.equal(inputs["taps"], reference.target_taps[:c]) and reference.taps == [0, 2, 4]

    embed = read_target(target.path).embed
    with torch.no_grad():
        served = DFLASH.reference(drafter, inputs, embed)
    assert (served - reference.hidden).abs().max().item() < 1e-5

    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(target.path)
    mrope, _ = model.model.get_rope_index(input_ids=ids[None], mm_token_type_ids=(ids[None] == IMAGE_PAD).int(),
                                          image_grid_thw=conversation["image_grid_thw"])  # (3, 1, S)
    temporal = mrope[0, 0]  # (S,)
    assert (temporal[:c] != torch.arange(c)).sum() > c // 2
    moved = dict(inputs, context_positions=temporal[:c], block_positions=temporal[c - 1] + 1 + torch.arange(BLOCK_SIZE))
    with torch.no_grad():
        other = DFLASH.reference(drafter, moved, embed)
    assert (other - reference.hidden).abs().max().item() > 1e-2


def test_judge_compares_the_engine_target_s_taps_and_expects_sglang_s_refusal(tmp_path, image_case):
    from serving_check.report import CANNOT_SERVE

    (job,), references, target = image_case
    ref = references[job.id]
    out = tmp_path / "out.pt"
    ran = dict(job=job.id, engine="vllm", status="ran", model_class="DFlashQwen3ForCausalLM", layers=ref.layers,
               taps=ref.taps, block_size=BLOCK_SIZE, outputs=str(out))
    logits = ref.hidden @ target.head.T
    for taps, result in [(ref.target_taps, PASS), (ref.target_taps + 1e-3, FAIL), (None, FAIL)]:
        torch.save({"hidden": ref.hidden, "logits": logits} | ({} if taps is None else {"target_taps": taps}), out)
        row = judge("vllm", job, EngineResult(**ran), ref, target.head, DFLASH.engine_classes)
        assert row.result == result, row.why
    refused = EngineResult(job=job.id, engine="sglang", status="refused", detail="AttributeError: ...")
    assert judge("sglang", job, refused, ref, target.head, DFLASH.engine_classes).result == CANNOT_SERVE
    text_job = _job()
    assert judge("sglang", text_job, refused, ref, target.head, DFLASH.engine_classes).result == FAIL
