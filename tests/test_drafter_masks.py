"""Anchors, labels and attention masks: hand-built cases cell by cell, determinism, flex == SDPA."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_trainer.drafter.anchors import plan_blocks, plan_from_anchors, token_seq_ids, valid_anchor_mask
from dflash_trainer.drafter.attention_mask import FlexMaskBuilder, dense_mask, flex_block_mask, mask_index, visible
from dflash_trainer.errors import ConfigError
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)

MASK = 99


def hand_case():
    """T=12: seq0 = slots 0-4, seq1 = slots 5-9, slots 10-11 padding. B=3; anchors 1, 6, 8 + one invalid."""
    cu = torch.tensor([0, 5, 10, 10], dtype=torch.int32)
    input_ids = torch.arange(100, 112)
    loss_mask = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    plan = plan_from_anchors(
        anchors=torch.tensor([1, 6, 8, 3]),
        block_valid=torch.tensor([True, True, True, False]),
        input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu, block_size=3, mask_token_id=MASK,
    )
    return plan, cu


def expected_dense(visible_keys: dict[int, set[int]], rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=torch.bool)
    for q, keys in visible_keys.items():
        out[q, sorted(keys)] = True
    return out


def test_hand_built_plan_labels_are_same_position():
    plan, _ = hand_case()
    assert plan.block_ids.tolist() == [[101, MASK, MASK], [106, MASK, MASK], [108, MASK, MASK], [100, MASK, MASK]]
    # slot k's label is the token AT anchor + k (no extra shift); slot 0 never a label
    assert plan.labels[0].tolist() == [0, 102, 103]
    assert plan.label_valid.tolist() == [
        [False, True, True],    # anchor 1: slots at 2, 3 supervised
        [False, True, True],    # anchor 6: 7, 8
        [False, True, False],   # anchor 8: 9 inside seq1, 10 is past its end
        [False, False, False],  # invalid block
    ]
    assert plan.anchor_pos.tolist() == [1, 1, 3, 0]
    assert plan.positions[2].tolist() == [3, 4, 5]
    assert plan.seq_id.tolist() == [0, 1, 1, -1]


def test_dense_mask_cell_by_cell_full_attention():
    plan, cu = hand_case()
    mask = dense_mask(mask_index(plan, cu, 12))
    assert mask.shape == (12, 24)
    T = 12
    blk = lambda j: {T + 3 * j + s for s in range(3)}
    want = {}
    for s in range(3):
        want[0 + s] = {0} | blk(0)            # anchor 1 in seq0: context slot 0 only (never the anchor)
        want[3 + s] = {5} | blk(1)            # anchor 6 (pos 1) in seq1: slot 5 only, not seq0, not 6
        want[6 + s] = {5, 6, 7} | blk(2)      # anchor 8 (pos 3): slots 5..7, never 8
        want[9 + s] = blk(3)                  # invalid block: only itself
    assert torch.equal(mask, expected_dense(want, 12, 24))
    # the kv < anchor boundary, explicitly
    assert not mask[3, 6] and mask[3, 5] and not mask[6, 8] and mask[6, 7]
    # packed isolation: seq1 blocks never see seq0 slots; no block sees padding slots 10, 11
    assert not mask[3:9, :5].any() and not mask[:, 10:12].any()


def test_dense_mask_sliding_window_is_causal_and_windowed():
    plan, cu = hand_case()
    mask = dense_mask(mask_index(plan, cu, 12), sliding_window=2)
    T = 12
    # block 2 (anchor 8, positions 3, 4, 5): slot 0 sees context pos 2 (slot 7) and itself
    assert mask[6].nonzero().flatten().tolist() == [7, T + 6]
    assert mask[7].nonzero().flatten().tolist() == [T + 6, T + 7]
    assert mask[8].nonzero().flatten().tolist() == [T + 7, T + 8]
    # invalid block stays finite: slot 0 sees itself
    assert mask[9].nonzero().flatten().tolist() == [T + 9]


def test_flex_mask_mod_matches_dense_cell_by_cell():
    plan, cu = hand_case()
    index = mask_index(plan, cu, 12)
    for window in (None, 2):
        block_mask = flex_block_mask(index, window)
        dense = dense_mask(index, window)
        q = torch.arange(12)[:, None].expand(12, 24)
        kv = torch.arange(24)[None, :].expand(12, 24)
        from_mod = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
        assert torch.equal(from_mod, dense)
        assert torch.equal(visible(index, q, kv, window), dense)


@pytest.mark.parametrize("sliding", [False, True])
def test_flex_and_sdpa_forward_agree(sliding):
    drafter, _ = tiny_drafter(sliding_layers=[1] if sliding else [], sliding_window=3 if sliding else None)
    batch = packed_batch(drafter, num_blocks=28)
    assert not batch.plan.block_valid.all()  # include invalid blocks
    outs = {}
    with torch.no_grad(), warnings.catch_warnings():  # flex has no CPU backward; unfused on CPU
        warnings.simplefilter("ignore")
        for kind in ("sdpa", "flex"):
            drafter.attention = kind
            outs[kind] = drafter.forward_train(
                taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight
            )
    assert torch.isfinite(outs["sdpa"]).all()
    torch.testing.assert_close(outs["flex"], outs["sdpa"], atol=1e-5, rtol=1e-5)


def test_token_seq_ids_and_valid_anchors():
    cu = torch.tensor([0, 3, 6, 6], dtype=torch.int32)
    seq = token_seq_ids(cu, 8)
    assert seq.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    loss_mask = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    # 2 is the last slot of seq0 (next is seq1): not an anchor; 4 is followed by an unsupervised slot;
    # 6 and 7 are padding
    assert valid_anchor_mask(loss_mask, seq).tolist() == [True, True, False, True, False, False, False, False]


def test_anchor_sampling_rules_and_determinism():
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=12, job_id=5)
    plan = batch.plan
    seq = token_seq_ids(batch.cu_seqlens, batch.input_ids.shape[0])
    valid_positions = valid_anchor_mask(batch.loss_mask, seq)
    anchors = plan.anchors[plan.block_valid]
    assert int(plan.block_valid.sum()) == min(12, int(valid_positions.sum()))
    assert valid_positions[anchors].all()
    assert torch.equal(anchors, torch.sort(anchors).values) and anchors.unique().numel() == anchors.numel()
    assert not plan.block_valid[int(plan.block_valid.sum()):].any()  # invalid blocks last
    again = packed_batch(drafter, num_blocks=12, job_id=5).plan
    other = packed_batch(drafter, num_blocks=12, job_id=6).plan
    assert torch.equal(again.anchors, plan.anchors) and torch.equal(again.block_valid, plan.block_valid)
    assert not torch.equal(other.anchors, plan.anchors)


def test_anchor_share_follows_supervised_tokens():
    # seq0 has 30 valid anchors, seq1 has 10: seq0 should get about 3/4 of the blocks
    cu = torch.tensor([0, 31, 42], dtype=torch.int32)
    loss_mask = torch.ones(42, dtype=torch.bool)
    ids = torch.zeros(42, dtype=torch.int64)
    share = []
    for job in range(100):
        plan = plan_blocks(input_ids=ids, loss_mask=loss_mask, cu_seqlens=cu, num_blocks=8, block_size=4,
                           mask_token_id=1, seed=0, epoch=0, job_id=job)
        share.append(float((plan.seq_id == 0).float().mean()))
    assert 0.68 < sum(share) / len(share) < 0.82


def test_too_many_blocks_refused():
    loss_mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ConfigError, match="num_blocks"):
        plan_blocks(input_ids=torch.zeros(4, dtype=torch.int64), loss_mask=loss_mask,
                    cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), num_blocks=5, block_size=2,
                    mask_token_id=1, seed=0, epoch=0, job_id=0)


def test_flex_builder_keeps_one_mask_mod_and_tracks_new_batches():
    drafter, _ = tiny_drafter()
    builder = FlexMaskBuilder()
    first = packed_batch(drafter, num_blocks=8, job_id=1)
    second = packed_batch(drafter, num_blocks=8, job_id=2)
    q = torch.arange(32)[:, None].expand(32, 72)
    kv = torch.arange(72)[None, :].expand(32, 72)
    masks = []
    for batch in (first, second):
        index = mask_index(batch.plan, batch.cu_seqlens, 40)
        block_mask = builder.build(index)
        masks.append(block_mask)
        assert torch.equal(block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv), dense_mask(index))
    assert masks[0].mask_mod is masks[1].mask_mod  # a compiled forward does not recompile per batch


@pytest.mark.parametrize("tile", [8, 16, 128])
@pytest.mark.parametrize("job_id", [1, 2, 3])
def test_tile_level_block_mask_equals_create_block_mask(tile, job_id):
    """The BlockMask built from the key intervals has exactly create_block_mask's partial and full tiles, in
    both directions (the backward reads the query-side ones), with invalid blocks, several packed sequences,
    padding slots and lengths that are not multiples of the tile."""
    from torch.nn.attention.flex_attention import create_block_mask

    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=28, job_id=job_id)
    assert not batch.plan.block_valid.all()
    index = mask_index(batch.plan, batch.cu_seqlens, batch.taps.shape[0])
    builder = FlexMaskBuilder()
    builder.tile = tile
    ours = builder.build(index)
    ref = create_block_mask(builder._mask_mod(None), B=None, H=None, Q_LEN=index.q_block.shape[0],
                            KV_LEN=index.k_block.shape[0], device="cpu", BLOCK_SIZE=tile, _compile=False)
    assert ours.shape == ref.shape
    for count, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                           ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        a_n, b_n = getattr(ours, count), getattr(ref, count)
        assert torch.equal(a_n, b_n), count
        a_i, b_i = getattr(ours, indices), getattr(ref, indices)
        for row in range(a_n.shape[-1]):
            n = int(a_n[0, 0, row])
            assert torch.equal(a_i[0, 0, row, :n], b_i[0, 0, row, :n]), (indices, row)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    if tile == 8:  # small tiles exercise full tiles too
        assert int(ours.full_kv_num_blocks.sum()) > 0


def test_mask_tiles_pairs_builds_the_same_block_mask_through_create_block_mask():
    """`drafter.mask_tiles=pairs` reaches the model's builder; both ways give the same tiles."""
    from dflash_trainer.config import load_config
    from dflash_trainer.train.trainer import build_drafter

    drafter, _ = tiny_drafter()
    config = load_config("demo", ["drafter.mask_tiles=pairs", f"drafter.num_layers={drafter.spec.num_layers}"])
    pairs = build_drafter(config, drafter.spec, torch.device("cpu"))
    assert not pairs._flex_masks.from_intervals and drafter._flex_masks.from_intervals
    batch = packed_batch(drafter, num_blocks=28, job_id=2)
    index = mask_index(batch.plan, batch.cu_seqlens, batch.taps.shape[0])
    ours, ref = FlexMaskBuilder().build(index), pairs._flex_masks.build(index)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())
