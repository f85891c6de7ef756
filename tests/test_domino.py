"""Domino drafters from ModelOpt's exports (`projector_type: domino`): read, refused where they can't run, and
evaluated as SGLang drafts them (slot 0 from the backbone, each later slot corrected by the GRU's state after the
tokens drafted before it; greedy)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.drafter.domino import domino_walk
from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.errors import ConfigError
from tests.drafter_helpers import tiny_drafter
from tests.eval_helpers import block_case, decoded_alike, fitted

GRU, EMB = 16, 12


def domino_drafter(block_size: int = 4, seed: int = 0, scale: float = 8.0) -> DFlashDrafter:
    """A Domino drafter of the tiny target: the fitted DFlash drafter's backbone, a random correction head whose
    output layer is scaled up so that its corrections move picks."""
    backbone = fitted(block_size=block_size).drafter
    spec = dataclasses.replace(backbone.spec, variant="domino", domino_gru_hidden=GRU, domino_emb_dim=EMB)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(spec)
    drafter.load_state_dict(backbone.state_dict(), strict=False)  # all but the correction head
    with torch.no_grad():
        drafter.embed_proj[2].weight.mul_(scale)
    return drafter.requires_grad_(False)


def test_a_domino_export_reads_back_with_modelopts_fields(tmp_path):
    drafter = domino_drafter()
    out = export_drafter(drafter, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["emb_dim"] == EMB
    assert {k: config["dflash_config"][k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len",
                                                     "gru_hidden_dim", "emb_dim")} == {
        "projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1, "gru_hidden_dim": GRU,
        "emb_dim": EMB}
    loaded = load_drafter(out)
    assert loaded.spec == drafter.spec and loaded.spec.draft_length == 3
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
            "embed_proj.2.weight"} <= set(loaded.state_dict())
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name

    for change, named in [({"shift_label": False}, "shift_label"), ({"pure_draft_prefix_len": 2}, "pure_draft_prefix_len 2"),
                          ({"gru_hidden_dim": None}, "gru_hidden_dim and emb_dim")]:
        (out / "config.json").write_text(json.dumps(config | {"dflash_config": config["dflash_config"] | change}))
        with pytest.raises(ConfigError, match=named):
            load_drafter(out)


def test_domino_is_evaluated_not_trained(tmp_path):
    with pytest.raises(ConfigError, match="does not train Domino"):
        load_config("demo", ["drafter.variant=domino"])
    out = export_drafter(domino_drafter(), tmp_path / "export")
    model, _ = tiny_drafter(block_size=4)
    with pytest.raises(ConfigError, match="is a Domino drafter"):
        init_from_export(model, out)
    drafter = domino_drafter()
    with pytest.raises(ConfigError, match="eval.temperature=0"):
        size = drafter.spec.hidden_size
        domino_walk(drafter.prefix_gru, drafter.embed_proj, torch.zeros(1, 2, size),
                    torch.zeros(drafter.spec.vocab_size, size), torch.zeros(drafter.spec.vocab_size, size),
                    torch.zeros(1, dtype=torch.int64), 0.7)


def test_each_slot_is_corrected_by_the_gru_over_the_tokens_before_it():
    """The reference proposer against the definition, the GRU run afresh over each slot's whole prefix: one forward of
    the block (the anchor, then mask tokens), slot 0 drafts from the backbone's logits, slot k >= 1 from them plus
    embed_proj([h_k ; GRU(embeddings of the anchor and the k drafts so far)])."""
    setup, drafter = fitted(block_size=4), domino_drafter()
    case = block_case(setup, drafter, slots=4)  # a block of 4 drafts 3, from slots 0..2
    drafted, hidden = case.drafted, case.hidden  # hidden (4, H)
    assert drafted.shape == (3,)
    embed, head = setup.target.get_input_embeddings().weight, setup.target.lm_head.weight
    tokens, base_picks = [case.anchor], []
    for k in range(3):
        scores = hidden[k] @ head.T
        base_picks.append(int(scores.argmax()))
        if k >= 1:
            _, state = drafter.prefix_gru(embed[torch.tensor(tokens)][None])  # the whole prefix, from a zero state
            scores = scores + drafter.embed_proj(torch.cat([hidden[k], state[0, 0]]))
        tokens.append(int(scores.argmax()))
    assert drafted.tolist() == tokens[1:]
    assert tokens[1:] != base_picks  # the head moved a pick: the correction is what is compared


def test_domino_decoding_batched_equals_the_reference_loop_and_the_target():
    """Rows decoded together equal each prompt decoded alone by the reference loop, and the target's own greedy
    output (lossless), also when the last block is cut short."""
    setup, drafter = fitted(block_size=4), domino_drafter()
    lengths = decoded_alike(setup, drafter, 26) + decoded_alike(setup, drafter, 9)  # 9 ends inside a block
    assert max(lengths) > 1  # some drafts were accepted: the drafting decided something


def test_checkpoints_saved_before_domino_keep_their_signature():
    """Domino's fields enter a drafter's signature only when set: the checkpoints of the trained variants, saved
    before those fields existed, still resume."""
    from dflash_trainer.train.trainer import DOMINO_FIELDS, model_signature

    for variant in ("dflash", "dflash2"):
        model, _ = tiny_drafter(block_size=4, variant=variant)
        assert not set(DOMINO_FIELDS) & set(model_signature(model.spec))
    assert {model_signature(domino_drafter().spec)[k] for k in DOMINO_FIELDS} == {GRU, EMB}
