"""Context parallel on CPU (gloo): one sequence sharded over 2 and 3 ranks gives the taps of the unsharded target
forward, and the drafter's sharded step gives the loss sums and every gradient of the one-rank step (D-PACE, several
blocks per shard, blocks in chunks); the settings that cannot work are refused with the key to change."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import free_port, leave_spawned_rank
from test_target_capture import H, capture, make_sequences

from dflash_trainer.config import load_config
from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.errors import ConfigError
from dflash_trainer.runtime.config import PipelineConfig
from dflash_trainer.runtime.roles import plan_placement
from dflash_trainer.runtime.setup import check_context_parallel
from dflash_trainer.target.capture import TapCapture, shard_inputs
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.context_parallel import SequenceShard, ShardAttention
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.load import load_target
from dflash_trainer.train.context_parallel import shard_blocks, shard_forward_backward
from dflash_trainer.train.micro_step import make_micro_step, step_loss
from dflash_trainer.transport.wire import HiddenStateBatch, WireSpec, allocate
from tests.drafter_helpers import tiny_drafter

TAPS = [0, 2, 4]
TARGET = TargetConfig(random_init="tiny", dtype="float32")
SEQ_LEN = 35  # the target's sequence: not a multiple of 2 or 3, so the last shard is padded
SLOTS, REAL, NUM_BLOCKS, CHUNK = 48, 45, 12, 3  # the drafter's batch: one sequence of 45 tokens in 48 slots


def _config():
    return load_config(None, ["target.random_init=tiny", "run.device=cpu", "train.dtype=float32",
                              f"pipeline.token_budget={SLOTS}", f"drafter.num_blocks={NUM_BLOCKS}",
                              "drafter.block_size=4", "drafter.gamma=2.0", "drafter.dpace=true"])


def _drafter_inputs():
    """The same drafter, frozen head and one-sequence batch on every rank (seeded)."""
    drafter, _ = tiny_drafter(block_size=4, num_layers=2)
    spec = drafter.spec
    gen = torch.Generator().manual_seed(3)
    head = TargetHead(embed_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
                      lm_head_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.1,
                      final_norm=torch.nn.Identity())
    input_ids = torch.randint(0, 200, (SLOTS,), generator=gen)
    loss_mask = torch.rand(SLOTS, generator=gen) > 0.2
    input_ids[REAL:], loss_mask[REAL:] = 0, False
    batch = HiddenStateBatch(
        job_id=5, bucket_id=0, epoch=0, num_tokens=REAL, num_seqs=1,
        cu_seqlens=torch.tensor([0, REAL], dtype=torch.int32), input_ids=input_ids, loss_mask=loss_mask,
        taps=torch.randn(SLOTS, spec.num_taps * spec.hidden_size, generator=gen),
    )
    return drafter, head, batch


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    group = dist.group.WORLD
    # (a) the target's forward of this rank's shard
    sequence = make_sequences((SEQ_LEN,))[0]
    attention = ShardAttention(group=group, shard=SequenceShard.of(SEQ_LEN, size=size, index=rank))
    model = load_target(TARGET, "cpu", seed=7)
    wire = WireSpec(token_budget=attention.shard.length, max_seqs=1, num_taps=len(TAPS), hidden=H,
                    dtype=torch.float32, has_last_hidden=False)
    out = allocate(wire, "cpu")
    TapCapture(model, TAPS).run(shard_inputs(sequence, attention, "cpu"), out)
    taps = out.taps[: attention.shard.real_tokens].clone()
    # (b) the drafter's step on this rank's shard of the batch
    config = _config()
    drafter, head, batch = _drafter_inputs()
    shard = SequenceShard.of(REAL, size=size, index=rank, padded_tokens=SLOTS)
    plan = plan_blocks(input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                       num_blocks=NUM_BLOCKS, block_size=4, mask_token_id=drafter.spec.mask_token_id,
                       seed=config.run.seed, epoch=batch.epoch, job_id=batch.job_id)
    own = shard_blocks(plan, shard).block_valid.sum()
    sums = shard_forward_backward(
        drafter, taps=batch.taps[shard.start : shard.stop], shard=shard, group=group, plan=plan,
        cu_seqlens=batch.cu_seqlens, embed=head.embed_weight, autocast=contextlib.nullcontext,
        loss_of=step_loss(config.drafter, head.lm_head_weight), blocks_per_chunk=CHUNK,
    )
    # what the drafters' step does with them: sum the sums and the gradients over the ranks
    packed = torch.cat([s.reshape(-1) for s in sums])
    dist.all_reduce(packed, group=group)
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    torch.save({"taps": taps, "sums": packed, "grads": grads, "own_blocks": own},
               os.path.join(out_dir, f"r{rank}.pt"))
    leave_spawned_rank()


@pytest.fixture(scope="module", params=[2, 3], ids=["cp2", "cp3"])
def sharded(request, tmp_path_factory):
    """Every rank's results of one spawned CP group of `size` ranks."""
    size, out_dir = request.param, tmp_path_factory.mktemp(f"cp{request.param}")
    mp.start_processes(_worker, args=(size, free_port(), str(out_dir)), nprocs=size, start_method="spawn")
    return size, [torch.load(out_dir / f"r{i}.pt", weights_only=True) for i in range(size)]


def test_sharded_target_taps_equal_the_whole_forward(sharded):
    size, ranks = sharded
    _, ref = capture(load_target(TARGET, "cpu", seed=7), make_sequences((SEQ_LEN,)), TAPS)
    got = torch.cat([r["taps"] for r in ranks])  # the shards' real tokens, in order
    assert got.shape == (SEQ_LEN, len(TAPS) * H)
    assert all(r["taps"].shape[0] > 0 for r in ranks)
    torch.testing.assert_close(got, ref.taps[:SEQ_LEN], rtol=1e-5, atol=1e-5)


def test_sharded_drafter_step_equals_the_one_rank_step(sharded):
    size, ranks = sharded
    drafter, head, batch = _drafter_inputs()
    one = make_micro_step(_config(), drafter, head, device=torch.device("cpu"), progress=lambda: 0.0)(batch)
    assert one.num_blocks.item() == NUM_BLOCKS and one.weight_sum.item() > 0
    # several blocks on every shard: the gathered context and the gradients sent back really carry work
    assert all(r["own_blocks"] >= 2 for r in ranks) and sum(int(r["own_blocks"]) for r in ranks) == NUM_BLOCKS
    want = torch.cat([t.reshape(-1) for t in (one.loss_sum, one.weight_sum, one.slot_correct, one.slot_count,
                                              one.tau_sum, one.num_blocks)])
    for r in ranks:
        torch.testing.assert_close(r["sums"], want, rtol=1e-5, atol=1e-5)
        for name, p in drafter.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_shards_split_the_blocks_of_the_whole_sequence():
    drafter, _, batch = _drafter_inputs()
    plan = plan_blocks(input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                       num_blocks=NUM_BLOCKS, block_size=4, mask_token_id=drafter.spec.mask_token_id,
                       seed=0, epoch=0, job_id=1)
    anchors = []
    for index in range(3):
        shard = SequenceShard.of(REAL, size=3, index=index, padded_tokens=SLOTS)
        own = shard_blocks(plan, shard)
        mine = own.anchors[own.block_valid]
        assert ((mine >= shard.start) & (mine < shard.stop)).all()
        anchors += mine.tolist()
    assert anchors == plan.anchors[plan.block_valid].tolist()  # every block once, in order
    empty = shard_blocks(plan, SequenceShard.of(REAL, size=4, index=3, padded_tokens=64))  # slots 48..63: no anchor
    assert empty.num_blocks == 1 and not empty.block_valid.any()


def test_shard_bounds():
    shards = [SequenceShard.of(35, size=3, index=i) for i in range(3)]
    assert [(s.start, s.stop, s.real_tokens) for s in shards] == [(0, 12, 12), (12, 24, 12), (24, 36, 11)]
    with pytest.raises(ValueError):
        SequenceShard.of(35, size=3, index=0, padded_tokens=40)


def test_context_parallel_settings_are_checked():
    cp = ["pipeline.context_parallel=2", "pipeline.colocated=true", "target.random_init=tiny"]
    config = load_config(None, cp)
    assert config.batch.max_seqs == 1  # one sequence a batch
    check_context_parallel(config)  # runs
    with pytest.raises(ConfigError, match="train.fsdp=true is not supported: set train.fsdp=false"):
        check_context_parallel(load_config(None, [*cp, "train.fsdp=true"]))
    with pytest.raises(ConfigError, match="pipeline.context_parallel must be >= 1"):
        load_config(None, ["pipeline.context_parallel=0", "target.random_init=tiny"])
    with pytest.raises(ConfigError, match="set pipeline.token_budget to a multiple of 3 .e.g. 16386"):
        load_config(None, ["pipeline.context_parallel=3", "pipeline.colocated=true", "target.random_init=tiny"])
    with pytest.raises(ConfigError, match="needs pipeline.colocated=true"):
        load_config(None, ["pipeline.context_parallel=2", "target.random_init=tiny"])
    with pytest.raises(ConfigError, match="set drafter.kd_weight=0"):
        load_config(None, [*cp, "drafter.kd_weight=0.5"])
    pipeline = PipelineConfig(context_parallel=2, colocated=True)
    placement = plan_placement(rank=0, world_size=4, local_rank=0, local_world_size=4, pipeline=pipeline)
    assert placement.context_groups == ((0, 1), (2, 3))
    assert placement.context_group == (0, 1) and placement.replicas == 2  # a CP group is one data-parallel replica
    with pytest.raises(ConfigError, match="needs a multiple of 2 ranks per node"):
        plan_placement(rank=0, world_size=3, local_rank=0, local_world_size=3, pipeline=pipeline)


def test_tap_noise_of_a_shard_is_its_rows_of_the_whole_batch_noise():
    """The noise is drawn on the whole batch's shape and sliced, so a CP shard's taps get the noise CP=1 gives them."""
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.noise import add_tap_noise

    taps = torch.randn(12, 6)
    for block_rows in (4096, 5):  # the shards in one noise block; across blocks (rows 4..8 span two of 5)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("dflash_trainer.drafter.noise.NOISE_BLOCK_ROWS", block_rows)
            for noise in ("gaussian", "uniform"):
                cfg = DrafterConfig(noise=noise, noise_std=0.5)
                whole = add_tap_noise(taps, cfg, progress=0.0, seed=1, epoch=0, job_id=3)
                assert not torch.equal(whole, taps)
                for lo, hi in ((4, 8), (0, 12), (10, 12), (5, 10)):
                    shard = add_tap_noise(taps[lo:hi], cfg, progress=0.0, seed=1, epoch=0, job_id=3, batch_rows=12,
                                          start=lo)
                    assert torch.equal(shard, whole[lo:hi]), (block_rows, noise, lo, hi)
            # blocks draw their own values: not one block's values repeated
            if block_rows == 5:
                assert not torch.allclose(whole[:5] - taps[:5], whole[5:10] - taps[5:10])
    with pytest.raises(ValueError, match="do not lie in a batch of 12 rows"):
        add_tap_noise(taps[4:8], cfg, progress=0.0, seed=1, epoch=0, job_id=3, batch_rows=12, start=10)
