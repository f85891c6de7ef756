"""DSpark drafters from other trainers' exports (ModelOpt's `projector_type: dspark`): read, refused where they can't
run, and evaluated as they decode (every slot drafting, each slot's logits biased by the previous slot's pick)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_trainer.drafter.dspark import markov_walk
from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.batched import ContextUpdate
from dflash_trainer.eval.speculative import target_generate
from tests.drafter_helpers import tiny_drafter
from tests.eval_helpers import (batch_proposer_for, block_case, decoded_alike, fitted, proposer_for, target_taps,
                                tiny_target_model)

RANK = 64


def dspark_drafter(block_size: int = 3, seed: int = 0) -> DFlashDrafter:
    """A DSpark drafter of the tiny target: the fitted DFlash drafter's backbone, random Markov head."""
    backbone = fitted().drafter
    spec = dataclasses.replace(backbone.spec, variant="dspark", markov_rank=RANK, block_size=block_size)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(spec)
    drafter.load_state_dict(backbone.state_dict(), strict=False)  # all but the Markov head
    return drafter.requires_grad_(False)


def bigram_head(drafter: DFlashDrafter, scale: float = 50.0) -> None:
    """Set the Markov head to the target's own greedy bigrams on the fitted prompts (the most frequent successor of
    each token), strong enough to decide the walk: drafts that the target often accepts."""
    setup = fitted()
    successors = collections.defaultdict(collections.Counter)
    for prompt in setup.prompts:
        out = target_generate(setup.target, prompt, max_new_tokens=40, stop_token_ids=[]).output_ids
        seq = prompt.tolist()[-1:] + out
        for a, b in zip(seq, seq[1:]):
            successors[a][b] += 1
    assert len(successors) <= RANK
    with torch.no_grad():
        drafter.markov_w1.weight.zero_()
        drafter.markov_w2.weight.zero_()
        for j, (prev, counts) in enumerate(successors.items()):
            drafter.markov_w1.weight[prev, j] = 1.0
            drafter.markov_w2.weight[counts.most_common(1)[0][0], j] = scale


def test_a_dspark_export_reads_back_and_carries_its_fields(tmp_path):
    drafter = dspark_drafter()
    out = export_drafter(drafter, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == RANK
    assert config["dflash_config"]["projector_type"] == "dspark"
    assert config["dflash_config"]["markov_rank"] == RANK and config["dflash_config"]["shift_label"] is True
    loaded = load_drafter(out)
    assert loaded.spec == drafter.spec and loaded.spec.draft_length == 3
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_confidence_head_is_left_out_and_other_heads_are_refused(tmp_path):
    out = export_drafter(dspark_drafter(), tmp_path / "export")
    state = load_file(str(out / "model.safetensors"))
    hidden = dspark_drafter().spec.hidden_size
    save_file(state | {"confidence_proj.weight": torch.zeros(1, hidden + RANK),
                       "confidence_proj.bias": torch.zeros(1)}, str(out / "model.safetensors"))
    assert load_drafter(out).markov_w1 is not None  # read, its confidence head left out

    config = json.loads((out / "config.json").read_text())
    for change, named in [({"markov_head_type": "gated"}, "markov_head_type 'gated'"),
                          ({"shift_label": False}, "shift_label false"),
                          ({"projector_type": "medusa"}, "projector_type is 'medusa'")]:
        (out / "config.json").write_text(json.dumps(config | {"dflash_config": config["dflash_config"] | change}))
        with pytest.raises(ConfigError, match=named):
            load_drafter(out)


def test_a_dflash_drafter_never_starts_from_a_dspark_export(tmp_path):
    out = export_drafter(dspark_drafter(), tmp_path / "export")
    model, _ = tiny_drafter(block_size=3)
    with pytest.raises(ConfigError, match="is a DSpark drafter"):
        init_from_export(model, out)


def test_every_slot_drafts_with_the_previous_slots_bias():
    """The batched proposer against the definition: one forward of the block (the anchor, then mask tokens), slot k's
    logits from its own hidden state (the anchor's slot drafts the next token), plus W2 W1[the token picked before]."""
    setup, drafter = fitted(), dspark_drafter()
    case = block_case(setup, drafter, slots=3)
    drafted, hidden, anchor = case.drafted, case.hidden, case.anchor  # hidden (3, H)
    assert drafted.shape == (3,)
    head = setup.target.lm_head.weight
    prev, expected = anchor, []
    for k in range(3):
        scores = hidden[k] @ head.T + drafter.markov_w2.weight @ drafter.markov_w1.weight[prev]
        prev = int(scores.argmax())
        expected.append(prev)
    assert drafted.tolist() == expected


def test_sampled_walk_draws_each_slot_from_its_biased_distribution():
    drafter = dspark_drafter()
    logits = torch.randn(2, 3, drafter.spec.vocab_size)
    anchors = torch.tensor([5, 9])
    walked = markov_walk(drafter.markov_w1, drafter.markov_w2, logits, anchors, 0.7, torch.Generator().manual_seed(0))
    prev = anchors
    for k in range(3):
        expected = F.softmax((logits[:, k] + drafter.markov_w2(drafter.markov_w1(prev))) / 0.7, dim=-1)
        assert torch.allclose(walked.probs[:, k], expected, atol=1e-6)
        prev = walked.tokens[:, k]


def test_dspark_decoding_batched_equals_the_reference_loop_and_the_target():
    """Rows decoded together equal each prompt decoded alone by the reference loop, and the target's own greedy
    output (lossless); the bigram head makes some steps accept several drafts."""
    setup, drafter = fitted(), dspark_drafter()
    bigram_head(drafter)
    width = drafter.spec.draft_length + 1
    lengths = decoded_alike(setup, drafter, 26) + decoded_alike(setup, drafter, 9)  # 9 ends inside a block: it shrinks
    assert max(lengths) == width and min(lengths) == 1


@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_a_block_cut_near_the_end_drafts_as_the_reference_loop_cuts_it(drafts):
    """Near max_new_tokens the block holds only the slots that can still be committed (the anchor's and drafts - 1
    masks); the sampled distributions are compared, which any change to a slot's hidden state moves."""
    setup, drafter = fitted(), dspark_drafter()
    prompt = setup.prompts[1]
    taps = target_taps(setup.target, prompt, drafter.spec.tap_layer_ids)  # (T, K*H)
    n, anchor = prompt.shape[0], int(prompt[-1])
    batched = batch_proposer_for(drafter, setup.target)
    batched.observe(ContextUpdate(tokens=prompt[None], positions=torch.arange(n)[None],
                                  valid=torch.ones(1, n, dtype=torch.bool), taps=taps[None]))
    got = batched.propose(torch.tensor([anchor]), torch.tensor([n]), torch.tensor([drafts]),
                          drafter.spec.draft_length + 1, 1.0, torch.Generator().manual_seed(3))
    reference = proposer_for(drafter, setup.target)
    reference.add_context(taps, torch.arange(n))
    want = reference.propose(anchor, n, drafts + 1, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(got.tokens[0, :drafts], want.tokens)
    assert torch.allclose(got.probs[0, :drafts], want.probs, atol=1e-6)


STUB_PEER = '''
import argparse, json, os, sys
sys.path.insert(0, os.environ["REPO"])
import torch
from transformers import AutoModelForCausalLM
from bench.peers.drafts_parity import our_drafts
from dflash_trainer.drafter.export import load_drafter
p = argparse.ArgumentParser()
for flag in ("--model", "--prompts", "--out", "--steps", "--markov-scale"):
    p.add_argument(flag)
args, _ = p.parse_known_args(sys.argv[2:])  # argv[1]: the peer's script, which this stands in for
target = AutoModelForCausalLM.from_pretrained(os.environ["TARGET"], dtype=torch.float32).eval()
drafter = load_drafter(os.environ["EXPORT"]).float().eval()
drafter.markov_w2.weight.data.mul_(float(args.markov_scale))
rows = []
for ids in json.loads(open(args.prompts).read())["prompts"]:
    prompt = torch.tensor(ids)
    anchor = int(target(prompt[None]).logits[0, -1].argmax())
    drafts = our_drafts(target, drafter, prompt, anchor)
    if os.environ.get("CORRUPT") and not rows:
        drafts[-1] = (drafts[-1] + 1) % drafter.spec.vocab_size
    rows.append({"anchor": anchor, "drafts": drafts})
json.dump({"steps": int(args.steps), "rows": rows}, open(args.out, "w"))
'''


@pytest.mark.parametrize("corrupt", [False, True])
def test_drafts_parity_passes_identical_drafts_and_fails_one_that_differs(tmp_path, tiny_tokenizer, corrupt):
    """`bench/peers/drafts_parity.py` against a stand-in for the peer's script that drafts as we do (or changes one
    draft): it asks for the export's draft length at the given Markov scale, compares every row, and exits 1 on a
    difference."""
    root = Path(__file__).resolve().parents[1]
    target_dir, export = tmp_path / "target", export_drafter(dspark_drafter(), tmp_path / "export")
    tiny_target_model().save_pretrained(target_dir)
    tiny_tokenizer.save_pretrained(target_dir)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                                                    for text in ("hello there", "the sea is wide", "count to three")))
    stub = tmp_path / "peer-python"
    (tmp_path / "stub.py").write_text(STUB_PEER)
    stub.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'stub.py'} \"$@\"\n")
    stub.chmod(0o755)
    env = dict(os.environ, REPO=str(root), TARGET=str(target_dir), EXPORT=str(export), CORRUPT="1" if corrupt else "",
               PYTHONPATH=str(root / "src"))
    done = subprocess.run([sys.executable, str(root / "bench" / "peers" / "drafts_parity.py"), "--peer-python", str(stub),
                           "--model", str(tmp_path), "--export", str(export), "--target", str(target_dir),
                           "--prompts", str(tmp_path / "prompts.jsonl"), "--markov-scale", "30",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == (1 if corrupt else 0), done.stderr[-3000:]
    result = json.loads(next((tmp_path / "out").glob("*-peers-drafts-parity-dspark.json")).read_text())
    assert result["prompts"] == 3 and result["drafts"] == 9 and result["markov_scale"] == 30.0
    assert result["identical"] is not corrupt
    assert result["drafts_agreeing"] == (8 if corrupt else 9)
