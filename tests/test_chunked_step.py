"""The chunked drafter step equals the one-pass step (loss sums, stats, every gradient), and the chunk planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spawn_helpers import leave_spawned_rank

from dflash_trainer.config import load_config
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.head import TargetHead
from dflash_trainer.train.chunking import auto_blocks_per_chunk, block_bytes, even_chunks, fixed_bytes, plan_chunks
from dflash_trainer.train.micro_step import make_micro_step
from dflash_trainer.transport.wire import HiddenStateBatch
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)

NUM_BLOCKS = 10


def _config(blocks_per_chunk: int, **drafter):
    overrides = ["target.random_init=tiny", "run.device=cpu", "train.dtype=float32", "pipeline.token_budget=48",
                 f"drafter.num_blocks={NUM_BLOCKS}", f"train.blocks_per_chunk={blocks_per_chunk}",
                 *(f"drafter.{k}={v}" for k, v in drafter.items())]
    return load_config(None, overrides)


def _step(drafter, config, batch: HiddenStateBatch, head: TargetHead):
    drafter.zero_grad(set_to_none=True)
    out = make_micro_step(config, drafter, head, device=torch.device("cpu"), progress=lambda: 0.0)(batch)
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return out, grads


def _batch(drafter, seqlens, kd: bool) -> HiddenStateBatch:
    helper = packed_batch(drafter, seqlens=seqlens, num_slots=48, num_blocks=NUM_BLOCKS, seed=3)
    h = drafter.spec.hidden_size
    return HiddenStateBatch(
        job_id=7, bucket_id=0, epoch=0, num_tokens=sum(seqlens), num_seqs=len(seqlens), cu_seqlens=helper.cu_seqlens,
        input_ids=helper.input_ids, loss_mask=helper.loss_mask, taps=helper.taps,
        last_hidden=torch.randn(48, h, generator=torch.Generator().manual_seed(5)) if kd else None,
    )


CASES = {
    "decay, two sequences": dict(seqlens=(15, 18, 9), drafter={}),
    "D-PACE": dict(seqlens=(15, 18, 9), drafter={"dpace": "true"}),
    "KD": dict(seqlens=(20, 22), drafter={"kd_weight": 0.5}),
    "sliding layer, D-PACE and KD": dict(seqlens=(15, 18, 9), drafter={"dpace": "true", "kd_weight": 0.3},
                                         sliding=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_step_equals_one_pass(case):
    spec_case = CASES[case]
    sliding = spec_case.get("sliding", False)
    drafter, _ = tiny_drafter(block_size=4, num_layers=2, sliding_layers=(1,) if sliding else (),
                              sliding_window=6 if sliding else None)
    spec = drafter.spec
    gen = torch.Generator().manual_seed(11)
    head = TargetHead(embed_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
                      lm_head_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.1,
                      final_norm=torch.nn.RMSNorm(spec.hidden_size))
    batch = _batch(drafter, spec_case["seqlens"], kd="kd_weight" in spec_case["drafter"])
    extra = dict(spec_case["drafter"], block_size=4, gamma=2.0)
    one, one_grads = _step(drafter, _config(0, **extra), batch, head)  # CPU auto: one pass
    assert one.num_blocks.item() == NUM_BLOCKS  # every block valid: chunks carry real work
    assert one.weight_sum.item() > 0 and len(one_grads) == len(list(drafter.parameters()))
    for size in (1, 3, 4, 7, NUM_BLOCKS):  # 3, 4 and 7 do not divide 10: the last chunk is padded
        out, grads = _step(drafter, _config(size, **extra), batch, head)
        for field in ("loss_sum", "weight_sum", "slot_correct", "slot_count", "tau_sum", "num_blocks"):
            torch.testing.assert_close(getattr(out, field), getattr(one, field), msg=f"{field} at {size}")
        assert grads.keys() == one_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, one_grads[name], atol=1e-5, rtol=1e-4, msg=f"{name} at {size}")


def test_a_chunked_step_really_runs_in_chunks(monkeypatch):
    """The sizes compared above really run in chunks: the equality is not one pass compared with itself."""
    drafter, _ = tiny_drafter(block_size=4)
    spec = drafter.spec
    head = TargetHead(embed_weight=torch.randn(spec.vocab_size, spec.hidden_size),
                      lm_head_weight=torch.randn(spec.vocab_size, spec.hidden_size), final_norm=torch.nn.Identity())
    calls = []
    forward = drafter.forward_train_blocks

    def counted(**kw):
        calls.append(kw["plan"].num_blocks)
        return forward(**kw)

    monkeypatch.setattr(drafter, "forward_train_blocks", counted)
    monkeypatch.setattr(drafter, "forward_train", lambda **kw: pytest.fail("one pass taken"))
    _step(drafter, _config(4, block_size=4, gamma=2.0), _batch(drafter, (15, 18), kd=False), head)
    assert calls == [4, 4, 4]  # 10 blocks: chunks of 4, the last padded with 2 invalid blocks


def test_select_pads_with_invalid_blocks():
    drafter, _ = tiny_drafter(block_size=4)
    plan = packed_batch(drafter, num_blocks=NUM_BLOCKS).plan
    part = plan.select(8, 12)
    assert part.num_blocks == 4
    assert part.block_valid.tolist() == plan.block_valid[8:].tolist() + [False, False]
    assert not part.label_valid[2:].any() and (part.seq_id[2:] == -1).all()
    assert torch.equal(part.positions[2:], torch.arange(4).expand(2, 4))
    whole = plan.select(0, NUM_BLOCKS)
    assert all(torch.equal(getattr(whole, f.name), getattr(plan, f.name)) for f in dataclasses.fields(plan))


def test_flex_masks_of_chunks_and_whole_batches_keep_their_own_mask_mods():
    """A chunked step's chunks and a validation's whole batches alternate on one model: each shape keeps its mask_mod
    (a compiled forward guards on it) and its masks stay right."""
    from dflash_trainer.drafter.attention_mask import FlexMaskBuilder, dense_mask, mask_index

    drafter, _ = tiny_drafter(block_size=4)
    batch = packed_batch(drafter, num_blocks=NUM_BLOCKS)
    builder = FlexMaskBuilder()
    mods = {}
    for part in (batch.plan, batch.plan.select(0, 4), batch.plan, batch.plan.select(4, 8)):
        index = mask_index(part, batch.cu_seqlens, 40)
        mask = builder.build(index)
        q, kv = index.q_block.shape[0], index.k_block.shape[0]
        assert mods.setdefault(q, mask.mask_mod) is mask.mask_mod
        dense = mask.mask_mod(torch.tensor(0), torch.tensor(0), torch.arange(q)[:, None], torch.arange(kv)[None, :])
        assert torch.equal(dense, dense_mask(index))
    assert len(mods) == 2


def test_even_chunks_split_into_the_fewest_equal_chunks():
    assert even_chunks(10, 4) == 4  # 3 chunks: 4, 4, 2 + 2 padding
    assert even_chunks(512, 100) == 86  # 6 chunks of 86 (4 padded), not 6 of 100 (88 padded)
    assert even_chunks(10, 10) == even_chunks(10, 50) == 10
    assert even_chunks(10, 0) == even_chunks(10, -5) == 1


def test_auto_chunk_size_shrinks_with_the_budget_and_covers_all_blocks_when_ample():
    spec = drafter_spec(*_qwen3_8b())
    shape = dict(num_blocks=5461, token_budget=32768, elem=2, loss_chunk_rows=4096, num_params=1_000_000_000)
    gib = 2**30

    def size(free_gib):
        return auto_blocks_per_chunk(spec, **shape, free_bytes=free_gib * gib, total_bytes=141 * gib)

    small, large = size(60), size(110)
    assert 1 <= small < large < shape["num_blocks"]
    assert size(10_000) == shape["num_blocks"]  # ample memory: one pass
    assert size(1) == 1  # nothing left: one block at a time
    # a compiled step keeps about half per block (counted as 0.6): 1/0.6 the blocks fit in the same budget
    compiled = auto_blocks_per_chunk(spec, **shape, free_bytes=60 * gib, total_bytes=141 * gib, compiled=True)
    assert 1.5 * small < compiled < 1.8 * small
    # the 8B drafter: about 20 MiB of activations per block (16 tokens x 5 layers), a few GiB fixed at 32K
    assert 15 * 2**20 < block_bytes(spec, 2) < 30 * 2**20
    fixed = fixed_bytes(spec, 2, token_budget=32768, loss_chunk_rows=4096, num_params=0)
    assert 5 * gib < fixed < 20 * gib


def test_plan_chunks_on_the_cpu_is_one_pass_unless_set():
    drafter, _ = tiny_drafter()
    common = dict(spec=drafter.spec, num_blocks=NUM_BLOCKS, token_budget=48, compute=torch.float32,
                  loss_chunk_rows=64, num_params=1000, device=torch.device("cpu"))
    assert plan_chunks(setting=0, **common).one_pass
    plan = plan_chunks(setting=3, **common)
    assert (plan.blocks_per_chunk, plan.num_chunks) == (3, 4)


def test_the_cpu_memory_check_counts_one_chunk_of_blocks(monkeypatch):
    """On the CPU the dense masks of a chunk, not of the whole batch, must fit in the host's memory."""
    from dflash_trainer.drafter.attention_mask import dense_step_bytes
    from dflash_trainer.runtime import setup

    drafter, _ = tiny_drafter(block_size=4)
    spec = drafter.spec
    whole = dense_step_bytes(num_blocks=NUM_BLOCKS, block_size=4, token_budget=48, num_layers=spec.num_layers)
    monkeypatch.setattr(setup, "available_host_bytes", lambda: whole - 1)
    with pytest.raises(ConfigError, match="all at once"):
        setup.check_cpu_step_memory(_config(0), spec, torch.device("cpu"))
    setup.check_cpu_step_memory(_config(4), spec, torch.device("cpu"))  # chunks of 4 blocks: fits


def test_negative_blocks_per_chunk_is_refused():
    with pytest.raises(ConfigError, match=r"train.blocks_per_chunk must be >= 0"):
        _config(-1)


def _qwen3_8b():
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.target.presets import preset_config

    return preset_config("qwen3-8b"), DrafterConfig(tap_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669)


def _sharded_worker(rank, port, out_dir):
    import os

    import torch.distributed as dist

    from dflash_trainer.train.parallel import shard_drafter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    drafter, _ = tiny_drafter(block_size=4, num_layers=2)
    spec = drafter.spec
    gen = torch.Generator().manual_seed(11)
    head = TargetHead(embed_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
                      lm_head_weight=torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.1,
                      final_norm=torch.nn.RMSNorm(spec.hidden_size))
    shard_drafter(drafter, dist.group.WORLD, torch.device("cpu"))
    batch = _batch(drafter, ((15, 18, 9), (20, 22))[rank], kd=False)  # each rank its own batch
    results = {}
    for size in (NUM_BLOCKS, 3):
        drafter.zero_grad(set_to_none=True)
        out = make_micro_step(_config(size, block_size=4, gamma=2.0), drafter, head, device=torch.device("cpu"),
                              progress=lambda: 0.0)(batch)
        results[size] = {"loss_sum": out.loss_sum.clone(),
                         "grads": {n: p.grad.full_tensor().clone() for n, p in drafter.named_parameters()}}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "sharded.pt"))
    dist.barrier()
    leave_spawned_rank()


def test_a_sharded_drafter_steps_in_chunks_as_in_one_pass(tmp_path):
    """FSDP2 (train.fsdp, gloo on the CPU): the chunked step's several backward passes (each chunk's, then the
    context's) give a sharded drafter the gradients one pass gives it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_sharded_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    results = torch.load(tmp_path / "sharded.pt", weights_only=True)
    one, chunked = results[NUM_BLOCKS], results[3]
    torch.testing.assert_close(chunked["loss_sum"], one["loss_sum"])
    assert chunked["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 0
    for name, grad in chunked["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, one["grads"][name], atol=1e-5, rtol=1e-4, msg=name)
