"""Tensor-parallel target groups on CPU (gloo): the taps of a target sharded over 2 ranks equal the taps of the
same weights on one rank; a target whose heads do not split is refused with the key to change."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import free_port, leave_spawned_rank
from test_target_capture import H, LENGTHS, capture, make_sequences

from dflash_trainer.errors import ConfigError
from dflash_trainer.target import parallel
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from dflash_trainer.target.parallel import check_shardable, shard_target, tensor_parallel_plan
from dflash_trainer.target.presets import preset_config

TAPS = [0, 2, 4]
TARGET = TargetConfig(random_init="tiny", dtype="float32")


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = load_target(TARGET, "cpu", seed=7)  # identical weights on both ranks (same seed)
    group = dist.new_group([0, 1])
    shard_target(model, group, torch.device("cpu"))
    up = model.model.layers[0].mlp.up_proj.weight
    _, out = capture(model, make_sequences(LENGTHS), TAPS, last_hidden=True)
    torch.save({"taps": out.taps.clone(), "last_hidden": out.last_hidden.clone(),
                "up_local": tuple(up.to_local().shape),
                "up_full": tuple(up.shape),
                "up_bytes": up.to_local().untyped_storage().nbytes()}, os.path.join(out_dir, f"r{rank}.pt"))
    leave_spawned_rank()


def test_tp2_taps_equal_tp1_taps(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"r{i}.pt", weights_only=True) for i in range(2)]
    _, ref = capture(load_target(TARGET, "cpu", seed=7), make_sequences(LENGTHS), TAPS, last_hidden=True)
    n = sum(LENGTHS)
    for r in ranks:
        # Really sharded: each rank holds half of the MLP's up projection (out features split).
        assert r["up_full"] == (128, H) and r["up_local"] == (64, H)
        assert r["up_bytes"] == 64 * H * 4  # the slice alone, not a view pinning the full weight
        torch.testing.assert_close(r["taps"][:n], ref.taps[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["last_hidden"][:n], ref.last_hidden[:n], rtol=1e-5, atol=1e-5)
    # The residual stream is replicated: both ranks capture the same taps, so one of them can send them.
    torch.testing.assert_close(ranks[0]["taps"], ranks[1]["taps"], rtol=1e-6, atol=1e-6)


def test_heads_that_do_not_split_are_refused():
    check_shardable(preset_config("tiny"), 2)  # 4 query heads, 2 key/value heads
    refusal = "pipeline.target_parallel=4 does not divide the target's num_key_value_heads=2"
    with pytest.raises(ConfigError, match=refusal):
        check_shardable(preset_config("tiny"), 4)


@pytest.mark.parametrize("api", ["installed", "5.17"])
def test_a_target_without_a_tensor_parallel_plan_is_refused(api, monkeypatch):
    """Without a plan the library shards nothing: every rank would hold the whole model, which is what
    target_parallel is there to avoid. Both transformers APIs: the installed one, and 5.17's (the device image's:
    `apply_tensor_parallelism(model, tp_mesh)` reading the model's `tp_plan`)."""
    if api == "5.17":
        monkeypatch.setattr(parallel, "apply_tensor_parallelism", lambda model, tp_mesh: model)
    model = load_target(TARGET, "cpu", seed=7)
    plan = tensor_parallel_plan(model, 2)
    assert plan and any(rule.endswith("mlp.up_proj") and style == "colwise" for rule, style in plan.items())
    model._tp_plan = {}
    model.config.base_model_tp_plan = None
    with pytest.raises(ConfigError, match=r"pipeline.target_parallel=2: cannot shard target Qwen3ForCausalLM .*; "
                                          r"use pipeline.target_parallel=1"):
        tensor_parallel_plan(model, 2)
