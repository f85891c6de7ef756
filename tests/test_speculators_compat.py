"""Our `--format speculators` export loaded by the `speculators` package's own loader (tiny target, fp32, CPU).

`DFlashDraftModel.from_pretrained` (speculators 0.9) reads our config.json and weights, and takes the
embedding and LM head from the verifier folder the export names. Its training forward (`_backbone_forward`,
the only one that returns hidden states and logits; `forward` returns a loss) runs random anchored blocks
over a packed batch of two documents with its own attention mask; each block must match our
`forward_block` on the same context, and its logits our hidden states through the target's LM head.
Its attention is set to `eager` (its default, flex attention with a compiled mask, is for GPUs).
Sliding-window layers are not compared: speculators windows a block's context from the anchor, we
window from each query position (the DFlash reference code's rule).

The package is not in the test extras: its pins exclude our transformers and datasets, so `scripts/setup.sh`
installs it with --no-deps, plus the modules it imports (openai, loguru, hs-connectors); CI runs these tests again
in the serving check's environment (transformers as the engines pin it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_trainer.drafter.export_speculators import export_speculators
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)

if importlib.util.find_spec("speculators") is None:
    pytest.skip("the `speculators` package is not installed", allow_module_level=True)
# installed but broken must fail, not skip
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # noqa: E402


def _load(export_dir):
    config = DFlashSpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "eager"
    return DFlashDraftModel.from_pretrained(str(export_dir), config=config, dtype=torch.float32).eval()


def test_speculators_loader_and_forward_match_ours(tmp_path):
    drafter, target_config = tiny_drafter()
    torch.manual_seed(3)
    target = Qwen3ForCausalLM(target_config).eval()
    target.save_pretrained(tmp_path / "verifier")
    export_speculators(drafter, tmp_path / "spec", verifier=str(tmp_path / "verifier"), target_config=target_config)
    model = _load(tmp_path / "spec")
    assert model.target_layer_ids == [t + 1 for t in drafter.spec.tap_layer_ids]
    assert model.mask_token_id == drafter.spec.mask_token_id and model.block_size == drafter.spec.block_size
    assert not model.use_draft_vocab  # the full vocabulary: no token maps
    theirs = model.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in drafter.state_dict().items())
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert torch.equal(model.embed_tokens.weight, embed) and torch.equal(model.lm_head.weight, head)  # not NaN

    spec, lengths = drafter.spec, (14, 17)
    gen = torch.Generator().manual_seed(5)
    total = sum(lengths)
    taps = torch.randn(total, spec.num_taps * spec.hidden_size, generator=gen)
    input_ids = torch.randint(0, spec.vocab_size - 1, (total,), generator=gen)
    starts = torch.tensor([0, lengths[0]]).repeat_interleave(torch.tensor(lengths))  # each token's document start
    positions = torch.arange(total) - starts
    documents = torch.tensor([0, 1]).repeat_interleave(torch.tensor(lengths))
    loss_mask = positions > 0  # an anchor needs one token of context (the reference's rule too)
    torch.manual_seed(7)  # speculators draws its anchors at random
    with torch.no_grad():
        hidden, logits, _, _, indices = model._backbone_forward(
            taps[None], input_ids[None], loss_mask[None].long(), torch.zeros(1, total, spec.hidden_size),
            documents[None], positions[None], max_anchors=6)
        worst = 0.0
        for j, anchor in enumerate(indices[:: spec.block_size].tolist()):
            start, pos = int(starts[anchor]), int(positions[anchor])
            block = [int(input_ids[anchor])] + [spec.mask_token_id] * (spec.block_size - 1)
            ours = drafter.forward_block(block_embeds=embed[block], block_positions=pos + torch.arange(spec.block_size),
                                         context_taps=taps[start:anchor], context_positions=torch.arange(pos)).hidden
            rows = slice(j * spec.block_size, (j + 1) * spec.block_size)
            torch.testing.assert_close(hidden[0, rows], ours, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[0, rows], ours @ head.T, atol=1e-5, rtol=1e-5)
            worst = max(worst, (hidden[0, rows] - ours).abs().max().item())
    anchors = indices[:: spec.block_size]
    assert len(anchors) == 6 and set(documents[anchors].tolist()) == {0, 1}  # blocks in both documents
    print(f"speculators forward vs ours: max |diff| of hidden states {worst:.2e}")


def test_same_fields_as_speculators_own_converter(tmp_path):
    """speculators converts a DFlash-format export given the verifier; our direct export must agree with it on
    every field it reads (the tap numbering above all)."""
    from speculators.convert.dflash.converter import DFlashConverter

    from dflash_trainer.drafter.export import export_drafter

    drafter, target_config = tiny_drafter(tap_layer_ids=[0, 2])
    Qwen3ForCausalLM(target_config).save_pretrained(tmp_path / "verifier")
    export_drafter(drafter, tmp_path / "dflash", target_config=target_config)
    verifier = str(tmp_path / "verifier")
    DFlashConverter().convert(tmp_path / "dflash", tmp_path / "converted", base_model=verifier, validate=False)
    export_speculators(drafter, tmp_path / "ours", verifier=verifier, target_config=target_config)
    theirs, ours = (DFlashSpeculatorConfig.from_pretrained(str(tmp_path / d)) for d in ("converted", "ours"))
    for field in ("speculators_model_type", "draft_vocab_size", "block_size", "mask_token_id",
                  "aux_hidden_state_layer_ids", "sample_from_anchor", "speculators_config"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # but one: the converter writes `false` whatever the layers, which vLLM 0.33 turns into causal attention in
    # every layer; our all-full-attention drafter's layers are non-causal inside the block, so ours writes `true`
    # (speculators itself reads the field for sliding layers only: its loader runs both the same)
    assert theirs.sliding_window_non_causal is False and ours.sliding_window_non_causal is True
    assert ours.aux_hidden_state_layer_ids == [1, 3]
    layer_fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "layer_types", "vocab_size",
                    "max_position_embeddings")
    for field in layer_fields:
        assert getattr(ours.transformer_layer_config, field) == getattr(theirs.transformer_layer_config, field), field
