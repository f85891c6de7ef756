"""The bench scripts end to end on the CPU (--smoke), the exactness of bench/flops.py's attention count, and
bench/kernel_profile.py's grouping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the `bench` package

from bench.flops import drafter_step_flops, lilicorr_step_flops, target_forward_flops, visible_pairs  # noqa: E402
from bench.quality.quality import pack, read_arms, run_overrides, split_conversations, unpack  # noqa: E402

from dflash_trainer.config import load_config  # noqa: E402
from dflash_trainer.drafter.anchors import plan_blocks  # noqa: E402
from dflash_trainer.drafter.attention_mask import dense_mask, mask_index  # noqa: E402
from dflash_trainer.eval.stats import tau_stderr  # noqa: E402

REQUIRED = ("date", "commit", "gpu", "workload", "tokens_per_s", "samples_per_s", "mfu", "baseline_tokens_per_s",
            "drafter_step_mfu", "target_mfu", "peak_gpu_mem_gb", "host_rss_drift_gb", "command", "target_ms",
            "drafter_ms", "speedup", "drafter_wait_frac", "target_idle_frac")


def test_smoke_run_writes_json_with_the_report_keys(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "speed" / "run.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = [k for k in REQUIRED if k not in last]
    assert not missing, missing
    files = list(tmp_path.glob("*-run-tiny-mfu.json"))
    assert len(files) == 1 and json.loads(files[0].read_text()) == last
    assert last["status"] == "ok" and last["baseline_status"] == "ok"
    assert last["workload"] == "mfu" and last["gpu"] == "cpu" and "--smoke" in last["command"]
    assert last["quantize"] == "none"  # and the file name has no -fp8
    assert last["token_budget"] == 256 and last["num_blocks"] == 32 and last["tap_layer_ids"] == [1, 3]
    assert last["tokens_per_s"] > 0 and last["baseline_tokens_per_s"] > 0 and last["speedup"] > 0
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 128)  # 2 sequences of 128 tokens
    assert 0 < last["mfu"] < 1 and last["target_ms"] > 0 and last["drafter_ms"] > 0
    # One GPU takes turns: the drafter's wait is the step minus its own time, the target's idle likewise.
    assert last["drafter_wait_frac"] == pytest.approx(1 - last["drafter_ms"] / last["step_ms"])
    assert last["target_idle_frac"] == pytest.approx(1 - last["target_ms"] / last["step_ms"])
    assert 0 < last["drafter_wait_frac"] < 1 and 0 < last["target_idle_frac"] < 1
    assert last["loss"] == pytest.approx(last["baseline"]["loss"], rel=0.05)  # same objective, random init
    assert "ours" in proc.stdout and "baseline" in proc.stdout


def test_run_set_overrides_our_side_and_prints_the_chunk_plan(tmp_path):
    """`--set` reaches the config our side runs (here its chunking, which the step then prints), and an unknown key
    is refused by name."""
    run = [sys.executable, str(ROOT / "bench" / "speed" / "run.py"), "--smoke", "--no-baseline", "--out", str(tmp_path)]
    proc = subprocess.run([*run, "--set", "train.blocks_per_chunk=8"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "drafter step: 32 blocks in 4 chunk(s) of 8 (train.blocks_per_chunk=8)" in proc.stdout
    assert "train.blocks_per_chunk=8" in json.loads(proc.stdout.strip().splitlines()[-1])["command"]
    bad = subprocess.run([*run, "--set", "drafter.nosuch=1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "drafter.nosuch" in bad.stdout + bad.stderr


def test_run_prices_a_drafter_whose_loss_reads_the_targets_last_hidden_state(tmp_path):
    """LiLiCorr's penalty reads the target's logits: the priced step captures the last hidden state, as training does."""
    run = [sys.executable, str(ROOT / "bench" / "speed" / "run.py"), "--smoke", "--no-baseline", "--out", str(tmp_path)]
    proc = subprocess.run([*run, "--set", "drafter.variant=lilicorr", "--set", "drafter.lilicorr_conv=true"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "ok" and result["step_ms"] > 0, result


def test_run_with_an_fp8_target_asks_for_it_and_is_refused_on_the_cpu_by_name():
    from bench.speed import run

    from dflash_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="target.quantize=fp8 needs a CUDA GPU"):
        run.main(["--smoke", "--quantize", "fp8"])


def test_a_scripts_stall_dumps_end_with_its_main_however_it_ends(monkeypatch):
    """The stall watchdog a bench script arms is cancelled when its `main` raises: left armed in a process that goes on
    (this one), it dumps the stacks of running threads every few minutes, which can crash the interpreter."""
    import faulthandler

    from bench.speed import run

    from dflash_trainer.errors import ConfigError

    calls = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *a, **k: calls.append("armed"))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: calls.append("cancelled"))
    with pytest.raises(ConfigError):
        run.main(["--smoke", "--quantize", "fp8"])
    assert calls == ["armed", "cancelled"]


def test_smoke_drafter_step_compares_variants_with_the_same_loss(tmp_path):
    """Named and free-form variants run the trainer's step on the same batch and head: a speed-only knob
    (chunk rows) leaves the loss unchanged; a bad variant is refused by name."""
    cmd = [sys.executable, str(ROOT / "bench" / "speed" / "drafter_step.py"), "--smoke", "--out", str(tmp_path),
           "--variant", "ours", "--variant", "chunk 4096", "--variant", "tiny chunks: drafter.loss_chunk_rows=5",
           "--profile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    results = {r["variant"]: r for r in last["results"]}
    assert list(results) == ["ours", "chunk 4096", "tiny chunks"]
    assert results["tiny chunks"]["overrides"] == ["drafter.loss_chunk_rows=5"]
    losses = [r["loss"] for r in results.values()]
    assert all(abs(x - losses[0]) < 1e-4 for x in losses), losses
    assert all(r["step_ms"] > 0 and r["step_tflop"] > 0 and r["profile"]["steps"] == 1 for r in results.values())
    assert len(list(tmp_path.glob("*-drafter_step-tiny.json"))) == 1
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "speed" / "drafter_step.py"), "--smoke", "--variant", "nosuch"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "nosuch" in bad.stderr


def _plan(lengths, budget, num_blocks, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.full((len(lengths) + 2,), sum(lengths), dtype=torch.int32)
    cu[: len(lengths) + 1] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    loss_mask = torch.rand(budget, generator=g) > 0.2
    ids = torch.randint(0, 50, (budget,), generator=g)
    plan = plan_blocks(input_ids=ids, loss_mask=loss_mask, cu_seqlens=cu, num_blocks=num_blocks,
                       block_size=block_size, mask_token_id=60, seed=seed, epoch=0, job_id=0)
    return plan, cu


@pytest.mark.parametrize("window", [None, 3, 7])
def test_visible_pairs_counts_the_mask_exactly(window):
    budget, b = 64, 4
    plan, cu = _plan([30, 20, 9], budget, num_blocks=12, block_size=b)
    mask = dense_mask(mask_index(plan, cu, budget), window)  # (N*B, T + N*B)
    valid_rows = plan.block_valid.repeat_interleave(b)
    assert plan.block_valid.sum() >= 6  # the case must have real blocks
    expected = float(mask[valid_rows].sum())
    assert visible_pairs(plan.anchor_pos[plan.block_valid], b, window) == expected


def test_flops_scale_as_documented():
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.spec import drafter_spec
    from dflash_trainer.target.presets import preset_config

    cfg = preset_config("tiny")
    one = target_forward_flops(cfg, [100], num_layers=2, lm_head=False)
    assert target_forward_flops(cfg, [100, 100], num_layers=2, lm_head=False) == 2 * one
    assert target_forward_flops(cfg, [100], num_layers=4, lm_head=False) == 2 * one
    assert target_forward_flops(cfg, [100], num_layers=2, lm_head=True) - one == 2 * 100 * 64 * cfg.vocab_size
    with pytest.raises(ValueError, match="num_layers=7 > the target's 6"):  # layer types are read per layer
        target_forward_flops(cfg, [100], num_layers=7, lm_head=False)
    spec = drafter_spec(cfg, DrafterConfig(num_layers=2, block_size=4, gamma=1.0, tap_layer_ids=[1, 3],
                                         mask_token_id=1024))
    anchors = torch.tensor([10, 20])
    base = drafter_step_flops(spec, anchor_pos=anchors, context_tokens=50)
    # moving anchors later adds only attention pairs: B * delta per block, 4*hd*heads per pair, x3, per layer
    later = drafter_step_flops(spec, anchor_pos=anchors + 1, context_tokens=50)
    assert later - base == 2 * 4 * (4 * 16 * 4) * 3 * 2


@pytest.mark.parametrize("width", [32, 0])
def test_lilicorr_head_flops_are_what_its_forward_runs(width):
    """The lattice head's forward + backward count (x3, token_proj x2) against torch's count of one forward; the
    LM-head parts (candidates, teacher) are outside the head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.lilicorr import LatticeHead
    from dflash_trainer.drafter.spec import drafter_spec
    from dflash_trainer.target.presets import preset_config

    spec = drafter_spec(preset_config("tiny"), DrafterConfig(
        variant="lilicorr", block_size=5, gamma=2.0, mask_token_id=1, lilicorr_hidden_size=width, lilicorr_candidate_topk=4,
        lilicorr_num_heads=2, lilicorr_factor_dim=16))
    head = LatticeHead(spec.lattice, model_hidden=spec.hidden_size, block_size=5, rms_norm_eps=1e-6)
    blocks, slots, k, hm = 3, 4, 4, spec.hidden_size
    # the math attention runs as matmuls torch counts (its fused CPU kernel has no count)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        head(torch.randn(blocks, slots, k, hm), torch.randn(blocks, slots, k), torch.randn(blocks, slots, hm),
             torch.randn(blocks, hm), torch.ones(blocks, dtype=torch.bool))
    parts = lilicorr_step_flops(spec, blocks)
    assert (parts["token_proj"] > 0) == (width == 32)
    forward = parts["token_proj"] / 2 + (parts["inputs"] + parts["layers"] + parts["factors"]) / 3
    assert forward == counter.get_total_flops()
    assert parts["teacher"] == 2 * blocks * slots * k * hm
    assert lilicorr_step_flops(drafter_spec(preset_config("tiny"), DrafterConfig(mask_token_id=1)), blocks) == {}


def test_moe_flops_count_active_experts():
    from dflash_trainer.target.presets import preset_config

    moe, dense = preset_config("tiny-moe"), preset_config("tiny")
    h, q, kv, experts, active, width = 64, 4 * 16, 2 * 16, 4, 2, 32  # the tiny-moe preset's sizes
    per_token = h * (q + 2 * kv) + q * h + h * experts + active * 3 * h * width  # attention linears, router, experts
    by_hand = 2 * (2 * 100 * per_token + 2 * 2 * q * 100 * 101 // 2)  # two layers, one 100-token sequence
    assert target_forward_flops(moe, [100], num_layers=2, lm_head=False) == by_hand
    assert target_forward_flops(moe, [100], num_layers=2, lm_head=False) != target_forward_flops(
        dense, [100], num_layers=2, lm_head=False)
    # a layer listed in mlp_only_layers is a dense MLP of intermediate_size, as in the dense tiny preset
    moe.mlp_only_layers = [0]
    assert target_forward_flops(moe, [100], num_layers=1, lm_head=False) == target_forward_flops(
        dense, [100], num_layers=1, lm_head=False)
    # gpt-oss: layer 0 slides (window 4: token t sees min(t + 1, 4) keys), layer 1 sees all; same MLP cost
    oss = preset_config("tiny-gpt-oss")
    layer0 = target_forward_flops(oss, [10], num_layers=1, lm_head=False)
    layer1 = target_forward_flops(oss, [10], num_layers=2, lm_head=False) - layer0
    assert layer1 - layer0 == 2 * 2 * q * (sum(range(1, 11)) - sum(min(t + 1, 4) for t in range(10)))


def test_target_forward_smoke_runs_a_moe_target_and_counts_active_experts():
    from dflash_trainer.target.presets import preset_config

    cmd = [sys.executable, str(ROOT / "bench" / "target" / "target_forward.py"), "--smoke", "--preset", "tiny-moe", "--profile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["preset"] == "tiny-moe" and [t["taps"] for t in last["targets"]] == [[0, 2, 4]]
    # a kernel profile of each budget's capture forward, and progress on stderr as each part ends
    assert [r["mode"] for r in last["rows"] if "profile" in r] == ["capture", "capture"]
    assert "kernel profile: tiny-moe none capture, budget 512" in proc.stdout
    assert "tiny-moe target, quantize none: built in" in proc.stderr
    config = preset_config("tiny-moe")
    for row in last["rows"]:
        lengths = [96] * (row["budget"] // 96) + [row["budget"] % 96]  # the smoke's 96-token sequences
        layers, head = (6, True) if row["mode"] == "full" else (5, False)
        flops = target_forward_flops(config, lengths, num_layers=layers, lm_head=head)
        assert row["mfu"] == pytest.approx(flops / (row["ms"] / 1e3) / (last["peak_tflops"] * 1e12))


def test_moe_experts_smoke_variants_agree_with_transformers_experts():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "large_targets" / "moe_experts.py"), "--smoke"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["preset"] == "tiny-moe" and last["k"] == 3
    assert [r["variant"] for r in last["rows"]] == ["grouped_mm", "index_copy", "index_add"]
    assert all(r["max_rel_diff"] < 1e-5 for r in last["rows"])


def test_target_parallel_smoke_tp2_taps_equal_tp1_taps():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "large_targets" / "target_parallel.py"), "--smoke"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["up_proj_full"] == [128, 64] and last["up_proj_local"] == [64, 64]  # really sharded
    assert max(last["tp2_vs_tp1_rel_error"]) < 1e-5 and last["rank0_vs_rank1_rel_error"] < 1e-6


def test_muon_step_smoke_times_every_rank_against_the_split_on_two_ranks():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "bench" / "speed" / "muon_step.py"), "--smoke"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["world"] == 2 and last["matrices"] > 0 and last["ns_tflop"] > 0
    assert set(last["step_ms"]) == {"every rank", "split over 2"}


def test_bench_scripts_take_the_moe_presets():
    from bench.speed import run

    for model, attention in (("tiny-moe", "sdpa"), ("tiny-gpt-oss", "eager")):
        args = run.parse_args(["--smoke", "--model", model])
        config = run.bench_config(args, torch.device("cpu"))
        assert config.target.random_init == model and config.target.attn_implementation == attention
    assert run.parse_args(["--smoke", "--model", "qwen3-30b-a3b"]).model == "tiny"  # --smoke keeps tiny models only
    for model in ("qwen3-30b-a3b", "gpt-oss-20b"):
        assert run.parse_args(["--model", model]).model == model


def test_sharegpt_workload_packs_approximate_lengths_into_the_budget():
    from bench.speed import run

    args = run.parse_args(["--smoke", "--workload", "sharegpt"])
    config = run.bench_config(args, torch.device("cpu"))
    workload = run.sharegpt_workload(6, config, args.seq_len, vocab=1024)
    assert len(workload.jobs) == 6 and "characters/4" in workload.note
    assert len({j.job_id for j in workload.jobs}) == 6
    for job in workload.jobs:
        seqs = [workload.dataset[i] for i in job.sequence_ids]
        assert job.num_tokens == sum(s.num_tokens for s in seqs) <= config.pipeline.token_budget
        for s in seqs:
            n = s.num_tokens
            assert 2 * config.drafter.block_size <= n <= args.seq_len
            assert not s.loss_mask[: n // 10].any() and s.loss_mask[n // 10 :].all()
            assert int(s.input_ids.max()) < 1024


def test_kernel_profile_kinds_and_idle_gaps():
    """Kernel names map to their kind; gaps are measured past the latest end (overlaps are not idle)."""
    from types import SimpleNamespace

    from bench.kernel_profile import idle_gaps, kind_of

    assert kind_of("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN") == "gemm"
    assert kind_of("triton_tem_fused_flex_attention_backward_6") == "flex attention"
    assert kind_of("triton_red_fused__to_copy_argmax_0") == "inductor fused"
    assert kind_of("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kind_of("Memcpy DtoH (Device -> Pageable)") == "copy / fill"
    assert kind_of("something_else") == "other"
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("a", 0, 100), event("b", 50, 300), event("c", 1300, 1400), event("host", 300, 1300, cpu),
              event("Optimizer.step#AdamW.step", 300, 1300), event("d", 1900, 2000)]
    assert idle_gaps(events, 5) == [(1.0, "b", "c"), (0.5, "c", "d")]  # us -> ms; "a" ends inside "b"


def test_smoke_scaling_runs_colocated_and_split_training(tmp_path):
    """bench/multi_gpu/scaling.py drives real training runs (one process, then torchrun with 3 gloo ranks split 1:2)
    and reports steady-state tokens/s and the efficiency against N x the one-rank run."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu" / "scaling.py"), "--smoke", "--out", str(tmp_path),
                           "--work-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    single, split = last["results"]
    assert single["roles"] == ["colocated"] and split["roles"] == ["target", "drafter", "drafter"]
    assert single["status"] == split["status"] == "ok" and single["efficiency"] == pytest.approx(1.0)
    assert split["steady_tokens_per_s"] > 0 and split["efficiency"] == pytest.approx(
        split["steady_tokens_per_s"] / (3 * single["steady_tokens_per_s"]))
    assert len(list(tmp_path.glob("*-scaling-3.json"))) == 1


def test_smoke_context_parallel_trains_one_long_sequence_a_step_on_one_rank_and_a_cp_group(tmp_path):
    """bench/multi_gpu/context_parallel.py writes long conversations, then trains one rank and a CP=2 group (torchrun, gloo)
    on them: every step is one sequence cut at exactly --seq-len tokens, and the CP group's speed-up and efficiency
    are taken against the one-rank run."""
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu" / "context_parallel.py"), "--smoke", "--out",
                           str(tmp_path), "--work-dir", str(runs)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    one, cp = last["results"]
    assert (one["ranks"], cp["ranks"]) == (1, 2) and one["status"] == cp["status"] == "ok"
    assert cp["roles"] == ["colocated", "colocated"] and one["speedup"] == pytest.approx(1.0)
    assert cp["efficiency"] == pytest.approx(cp["steady_tokens_per_s"] / (2 * one["steady_tokens_per_s"]))
    for name in ("1_rank", "CP=2"):
        (metrics,) = runs.glob(f"*/{name}/metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"tokens"' in line]
        assert [(r["batches"], r["tokens"]) for r in rows] == [(1, last["seq_len"])] * last["steps"], name
    assert len(list(tmp_path.glob("*-context_parallel-256.json"))) == 1


@pytest.mark.parametrize("argv", [["--seq-len", "131072", "--cp", "2,4", "--set",
                                   "drafter.flex_kernel_options.BACKEND=FLASH"], ["--smoke"]])
def test_context_parallel_runs_are_valid_configs(argv, tmp_path):
    """The GPU runs of bench/multi_gpu/context_parallel.py are checked only on a multi-GPU machine: a misspelt or refused
    override would fail there, after the data work."""
    from bench.multi_gpu import context_parallel

    args = context_parallel.parse_args(argv)
    target = context_parallel.long_target(tmp_path / "target", args.preset, args.seq_len)
    common = context_parallel.run_overrides(args, data=tmp_path / "long.jsonl", target=target)
    for _, _, extra in context_parallel.run_plan(args):
        config = load_config("demo", common + extra)  # raises ConfigError naming the bad override
        assert (config.pipeline.token_budget, config.data.max_length) == (args.seq_len, args.seq_len)


def test_context_parallel_plan_refuses_a_group_that_does_not_divide_the_sequence():
    from bench.multi_gpu import context_parallel

    plan = context_parallel.run_plan(context_parallel.parse_args(["--seq-len", "4096", "--cp", "2,4"]))
    assert [(name, ranks) for name, ranks, _ in plan] == [("1 rank", 1), ("CP=2", 2), ("CP=4", 4)]
    with pytest.raises(SystemExit, match="--cp 3"):
        context_parallel.run_plan(context_parallel.parse_args(["--seq-len", "4096", "--cp", "3"]))
    with pytest.raises(SystemExit, match="nothing to run"):
        context_parallel.run_plan(context_parallel.parse_args(["--cp", "", "--no-baseline"]))


def test_scaling_plan_runs_each_split_once_per_target_parallel_value():
    from bench.multi_gpu import scaling

    plan = scaling.run_plan(scaling.parse_args(["--gpus", "4", "--splits", "1,2", "--target-parallel", "1,2"]))
    # 2 groups of 2 would leave no drafter rank: skipped
    assert [(name, ranks) for name, ranks, _ in plan] == [
        ("1 colocated", 1), ("1:3 split", 4), ("1xTP2:2 split", 4), ("2:2 split", 4)]
    assert plan[2][2] == ["pipeline.colocated=false", "pipeline.num_targets=1", "pipeline.target_parallel=2"]
    with pytest.raises(SystemExit, match="a split needs 1..3 target ranks"):
        scaling.run_plan(scaling.parse_args(["--gpus", "4", "--splits", "4"]))


def test_smoke_data_prep_times_one_process_against_workers_with_equal_results(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host" / "data_prep.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["conversations"] == 300 and [r["workers"] for r in last["rows"]] == [1, 2]
    assert all(r["same_as_one_process"] and r["seconds"] > 0 for r in last["rows"])
    assert last["rows"][0]["speedup"] == 1.0
    written = list(tmp_path.glob("*-host-data_prep-300x2.json"))  # the result file tokenize_pool.sh brings back
    assert len(written) == 1
    saved = json.loads(written[0].read_text())
    assert saved["rows"] == last["rows"] and saved["max_length"] == 3072 and saved["commit"]


def test_smoke_target_padded_taps_match_each_sequence_alone_with_and_without_mask():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "target" / "target_padded.py"), "--smoke", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = last["tap_relative_error_vs_fp32_alone"]
    assert set(errors) == {"padded", "padding mask", "no cudnn sdpa"}
    for name, per_tap in errors.items():  # fp32 on the CPU: the padded batch equals each sequence alone
        assert len(per_tap) == 2 and max(per_tap) < 1e-5, (name, per_tap)
    assert set(last["results"]) == {"padded", "padding mask", "no cudnn sdpa", "equal"}


def test_train_steady_counts_tokens_after_the_skipped_records(tmp_path):
    from bench.speed import train_steady

    # One record per step, stamped when it ends: step 1 (compilation) ends at 110 s, then one every 2 s.
    rows = [{"step": i + 1, "time": 110.0 + 2.0 * i, "tokens": 1000 + i, "wait_time_s": 0.5} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = train_steady.steady(tmp_path, skip=1)
    # window: records 2..6 (times 112..120); the tokens of steps 3..6 over those 8 s
    assert r["steady_steps"] == 4 and r["steady_tokens_per_s"] == pytest.approx((1002 + 1003 + 1004 + 1005) / 8)
    assert r["mean_step_s"] == pytest.approx(2.0) and r["mean_wait_s"] == pytest.approx(0.5)
    assert r["first_steps_s"] == pytest.approx(2.0)
    with pytest.raises(SystemExit, match="train longer"):
        train_steady.steady(tmp_path, skip=5)


def test_quality_bench_regenerates_trains_arms_in_parallel_and_packs_its_cache(tmp_path):
    """bench/quality/quality.py on a random tiny target: regenerate (held-out split of the bundled ShareGPT file; the
    training prompts a second time, sampled), two arms in parallel processes trained on both sources, result
    JSONs with real tau beside prompt lookup and walk tau; the packed cache restores to the same data, and a rerun
    on it regenerates nothing."""
    small = ["run.device=cpu", "regenerate.batch_size=16", "regenerate.max_new_tokens=24", "data.max_length=384",
             "pipeline.token_budget=768", "train.max_steps=4", "eval.interval=2", "eval.max_new_tokens=12",
             "drafter.num_layers=1", "data.cache_dir=" + str(tmp_path / "tok")]
    arms = tmp_path / "arms.txt"
    arms.write_text("# two arms\na " + " ".join(small) + "\nb train.lr=1e-3 " + " ".join(small) + "\n")
    common = ["--target", "tiny", "--eval-prompts", "3", "--train-conversations", "24", "--results",
              str(tmp_path / "results"), "--sampled-replies", "3", "--sampled-temperature", "0.7"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), *common, "--cache", str(tmp_path / "c1"),
                           "--runs", str(tmp_path / "runs"), "--arms", str(arms), "--parallel", "2",
                           "--pack", str(tmp_path / "parts"), "regenerate.max_new_tokens=24"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(r["name"] for r in last["runs"]) == ["a", "b"]
    for name in ("a", "b"):
        (found,) = (tmp_path / "results").glob(f"*-quality-{name}.json")
        result = json.loads(found.read_text())
        assert result["steps"] == 4 and result["tau"] >= 1.0 and result["prompt_lookup_tau"] >= 1.0
        assert result["walk_tau"] >= 1.0 and 1 <= result["val"]["replies"] <= 3 and len(result["evals"]) == 2
        committed, steps = result["per_prompt_committed"], result["per_prompt_steps"]
        assert len(steps) == len(committed) == 3 and result["tau"] == pytest.approx(sum(committed) / sum(steps))
        assert result["tau_stderr"] == pytest.approx(tau_stderr(committed, steps))
        lookup = (result["prompt_lookup_per_prompt_committed"], result["prompt_lookup_per_prompt_steps"])
        assert result["prompt_lookup_tau"] == pytest.approx(sum(lookup[0]) / sum(lookup[1]))
    # the training prompts answered again, three times each, sampled (the greedy ones not): both sources trained
    # on whole, weighted by their sizes
    c1 = tmp_path / "c1"
    sampled = [json.loads(line) for f in sorted((c1 / "sampled").glob("shard_*.jsonl")) for line in f.open()]
    settings = json.loads((c1 / "sampled" / "manifest.json").read_text())["settings"]
    assert settings["temperature"] == 0.7 and settings["num_samples"] == 3
    assert json.loads((c1 / "train" / "manifest.json").read_text())["settings"]["temperature"] == 0.0
    assert result["data"]["sampled_rows"] == len(sampled) == 3 * result["data"]["train_rows"]
    config = yaml.safe_load((tmp_path / "runs" / "a" / "config.yaml").read_text())
    assert config["data"]["path"] is None
    weights = [(Path(s["path"]).name, s["weight"]) for s in config["data"]["sources"]]
    assert weights == [("train", 1.0), ("sampled", 3.0)]
    assert list((tmp_path / "parts").glob("quality-cache.tar.gz.part*"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), *common, "--cache", str(tmp_path / "c2"),
                           "--unpack", str(tmp_path / "parts"), "--data-only"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'cached': True" in proc.stdout
    assert (tmp_path / "c2" / "eval.jsonl").read_text() == (tmp_path / "c1" / "eval.jsonl").read_text()
    assert sorted(f.name for f in (tmp_path / "c2" / "sampled").iterdir()) == \
        sorted(f.name for f in (tmp_path / "c1" / "sampled").iterdir() if not f.name.endswith(".lock"))
    # more held-out prompts, ending at their second user turn: only the evaluation set is regenerated (every
    # turn of it, so the prompts hold the target's own earlier replies), the training set stays as it was
    c2 = tmp_path / "c2"
    shutil.rmtree(c2 / "eval")
    (c2 / "eval.jsonl").unlink()
    subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), "--cache", str(c2), "--prompts-only",
                    "--eval-prompts", "5", "--eval-turns", "2", "--train-conversations", "24"], check=True,
                   timeout=120, cwd=ROOT, env=env)
    train_before = {f"{d}/{f.name}": f.read_bytes() for d in ("train", "sampled") for f in (c2 / d).iterdir()}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), *common, "--cache", str(c2),
                           "--data-only", "regenerate.batch_size=16", "regenerate.max_new_tokens=24", "run.device=cpu"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'eval_rows': 5" in proc.stdout
    assert {f"{d}/{f.name}": f.read_bytes() for d in ("train", "sampled") for f in (c2 / d).iterdir()} == train_before
    prompts = [json.loads(line)["messages"] for line in (c2 / "eval_prompts.jsonl").open()]
    answered = [json.loads(line)["messages"] for line in (c2 / "eval.jsonl").open()]
    assert all([m["role"] for m in p] == ["user", "assistant"] * 2 for p in prompts)
    assert [[m["content"] for m in a if m["role"] == "user"] for a in answered] == \
        [[m["content"] for m in p if m["role"] == "user"] for p in prompts]  # both turns kept, in order
    # the second turn's prompt holds the target's reply to the first, not ShareGPT's
    assert all(a[1]["role"] == "assistant" and a[1]["content"] != p[1]["content"] for a, p in zip(answered, prompts))
    # other sampling flags than the cache's: refused, with the flags that match
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), *common[:-4], "--cache", str(c2),
                           "--data-only"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "holds 3 replies a prompt sampled at temperature 0.7, not --sampled-replies 2" in proc.stderr
    assert "pass --sampled-replies 3 --sampled-temperature 0.7" in proc.stderr
    # a cache without the sampled replies: --no-regen names what is missing and how to train without it
    shutil.rmtree(c2 / "sampled")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "quality.py"), *common, "--cache", str(c2),
                           "--data-only", "--no-regen"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0 and "no regenerated sampled data" in proc.stderr
    assert "--sampled-replies 0" in proc.stderr


def test_quality_runs_read_the_greedy_folder_alone_or_both_whole(tmp_path):
    """bench/quality/quality.py's run overrides: `--sampled-replies 0` trains on the greedy folder; otherwise both folders,
    the sampled one weighted by its rows per greedy row (data.sources cuts sources to their weights)."""
    import argparse

    for name, rows in (("train", 4), ("sampled", 10)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard_00000.jsonl").write_text('{"messages": []}\n' * rows)
    args = argparse.Namespace(cache=str(tmp_path), target="tiny", eval_prompts=3, sampled_replies=0)
    assert f"data.path={tmp_path / 'train'}" in run_overrides(args, tmp_path / "run")
    args.sampled_replies = 3  # fewer rows than 3 a prompt (some skipped): the weight follows the rows
    config = load_config("practice", [o for o in run_overrides(args, tmp_path / "run") if o.startswith("data.")])
    assert config.data.path is None
    assert [(Path(s.path).name, s.weight) for s in config.data.sources] == [("train", 1.0), ("sampled", 2.5)]


def test_unpack_restores_what_the_cache_lacks_and_keeps_what_it_has(tmp_path):
    """bench/quality/quality.py --unpack into a cache that holds the greedy replies already: the sampled ones and the
    held-out set come from the parts, the greedy folder stays as it was."""
    packed = tmp_path / "packed"
    for name in ("train", "sampled", "eval"):
        (packed / name).mkdir(parents=True)
        (packed / name / "shard_00000.jsonl").write_text(f"{name} from the parts\n")
    (packed / "eval.jsonl").write_text("held-out\n")
    pack(packed, tmp_path / "parts")
    cache = tmp_path / "cache"
    (cache / "train").mkdir(parents=True)
    (cache / "train" / "shard_00000.jsonl").write_text("train already here\n")
    assert unpack(tmp_path / "parts", cache) == ["eval", "eval.jsonl", "sampled"]
    assert (cache / "train" / "shard_00000.jsonl").read_text() == "train already here\n"
    assert (cache / "sampled" / "shard_00000.jsonl").read_text() == "sampled from the parts\n"
    assert (cache / "eval.jsonl").read_text() == "held-out\n" and not (cache / "quality-cache.tar.gz").exists()
    assert unpack(tmp_path / "parts", cache) == []  # nothing left to restore


def test_cpu_scaling_counts_every_process_loop_and_the_host_ticks():
    """bench/host/cpu_scaling.py: K processes each run the loop once (aggregate rate = K x loops / wall), and the host's
    CPU ticks are read by kind (steal included) where /proc/stat exists."""
    from bench.host import cpu_scaling

    r = cpu_scaling.run(2, 200_000)
    assert r["processes"] == 2 and 0 < r["fastest_s"] <= r["slowest_s"] <= r["wall_s"]
    assert r["loops_per_s"] == pytest.approx(2 * 200_000 / r["wall_s"])
    ticks = cpu_scaling.cpu_ticks()
    if Path("/proc/stat").is_file():
        assert {"user", "idle", "steal"} <= ticks.keys() and ticks["idle"] > 0


def test_peer_best_picks_cheapest_per_real_token_at_the_examples_anchors(tmp_path):
    """bench/peers/peer_best.py: a setting that failed is never picked; among those that ran at the example's 512
    anchors the cheapest per real token wins (a faster step carrying fewer real tokens can lose), an 80-anchor
    setting only when no 512 ran; the cells train it for the budget's steps scaled by our step's card ratio, with a
    4% warm-up and the setting's own overrides; no setting that ran exits 3."""
    from bench.peers.peer_best import main

    def price(name, **kw):
        record = {"name": name, "batch": 8, "seq_len": 768, "anchors": 512, "peer_overrides": [],
                  "step_s_after_warmup": 1.0, "steps": 20, "real_tokens": 20 * 2000} | kw
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
        return tmp_path / f"{name}.json"

    plain = price("plain")                                         # 500 us per real token
    rows16 = price("rows16", batch=4, seq_len=1280, step_s_after_warmup=0.9, real_tokens=20 * 1500)  # 600 us
    compiled = price("compiled", step_s_after_warmup=0.8, peer_overrides=["dflash.dflash_use_torch_compile=true"])
    failed = price("failed", status="failed", out_of_memory=True, step_s_after_warmup=None, steps=None,
                   real_tokens=None)
    few = price("few-anchors", anchors=80, step_s_after_warmup=0.1, peer_overrides=["dflash.dflash_num_anchors=80"])
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"step_ms": 400.0}))
    cells, results = tmp_path / "cells.txt", tmp_path / "results"
    args = ["--cells", str(cells), "--ours", str(ours), "--ours-ref-step-s", "0.5", "--results", str(results)]
    assert main([str(p) for p in (plain, rows16, compiled, failed, few)] + args) == 0
    lines = cells.read_text().splitlines()
    assert len(lines) == 12 and lines[0] == (
        "modelopt-best-5min-random-s0 --batch 8 --seq-len 768 --max-steps 300 --init random --seed 0 "
        "--peer-overrides training.warmup_steps=12 dflash.dflash_use_torch_compile=true")  # 300 s x 0.8 / 0.8 s
    assert any(line.startswith("modelopt-best-15min-target-s2 ") and "--max-steps 900 " in line for line in lines)
    record = json.loads(next(results.iterdir()).read_text())
    assert record["picked"] == "compiled" and record["card_scale"] == pytest.approx(0.8)
    assert main([str(rows16), str(plain)] + args) == 0 and "--batch 8 --seq-len 768" in cells.read_text()
    assert main([str(failed), str(few)] + args) == 0 and "dflash.dflash_num_anchors=80" in cells.read_text()
    assert main([str(failed)] + args) == 3
    # a DSpark setting (block 15): its cells keep the block size and say which drafter they train
    dspark = price("dspark", block_size=15, seq_len=765, peer_overrides=[
        "dflash.dflash_architecture_config.projector_type=dspark", "dflash.dflash_architecture_config.markov_rank=256"])
    assert main([str(dspark)] + args + ["--inits", "random"]) == 0
    lines = cells.read_text().splitlines()
    assert len(lines) == 6 and lines[0].startswith("modelopt-dspark-best-5min-random-s0 --batch 8 --seq-len 765 "
                                                   "--block-size 15 --max-steps ")
    assert all("projector_type=dspark" in line for line in lines)


def test_peer_driver_template_shape_and_step_budget(tmp_path):
    """bench/peers/peers.py's pure parts: the answer-only template renders the target's text exactly and tags each
    reply; a template it does not know is refused; the peer's drafter gets our shape and the target's head sizes
    and rope theta; the calibrated step count follows the measured rate after warm-up; the data keeps messages."""
    from bench.peers.peers import drafter_overrides, generation_template, steps_for_budget, write_peer_data
    from transformers import AutoTokenizer

    practice = ROOT.parent / "shared" / "practice_target" / "model"
    if not practice.is_dir():
        pytest.skip("the practice target (../shared/practice_target) is not beside this checkout")
    tokenizer = AutoTokenizer.from_pretrained(practice)
    rows = [[{"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "and?"}, {"role": "assistant", "content": ""}]]
    tagged = generation_template(tokenizer, rows)
    assert tagged.count("{% generation %}") == 1
    masked = tokenizer.apply_chat_template(rows[0], chat_template=tagged, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    ids, mask = masked["input_ids"], masked["assistant_masks"]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "yo<|im_end|><|im_end|>"  # replies + end of turn
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(SystemExit, match="write a"):
        generation_template(tokenizer, rows)

    overrides = drafter_overrides(practice, num_layers=5, block_size=16, mask_token_id=5)
    assert "dflash.dflash_architecture_config.target_layer_ids=[0,1,2,3,4]" in overrides
    assert {"dflash.dflash_architecture_config.num_attention_heads=5", "dflash.dflash_architecture_config.head_dim=64",
            "dflash.dflash_architecture_config.rope_theta=1000000.0", "dflash.dflash_block_size=16"} <= set(overrides)

    stats = {"step_ends_s": [5.0 + 0.5 * i for i in range(40)]}  # 2 steps/s once warm
    assert steps_for_budget(stats, 60.0) == 120
    with pytest.raises(SystemExit, match="calibration ran only"):
        steps_for_budget({"step_ends_s": [1.0] * 5}, 60.0)

    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "manifest.json").write_text("{}")
    (regen / "shard_00000.jsonl").write_text(json.dumps({"messages": rows[0], "id": "s:0"}) + "\n")
    assert write_peer_data(regen, tmp_path / "peer.jsonl") == 1
    assert json.loads((tmp_path / "peer.jsonl").read_text()) == {"messages": rows[0]}


def test_peer_warm_start_loads_every_draft_tensor_or_refuses(tmp_path):
    """peer_modelopt_run.py's warm start: our export's tensors land in the peer's draft module by name (rotary
    buffers and the target's embedding / head left as built); a file missing a tensor or with another shape is
    refused before training, never half loaded. Also the peer's steady step time (warm-up left out)."""
    from types import SimpleNamespace

    from bench.peers.peers import steady_step_s, step_time_summary

    assert steady_step_s([9.0, 9.5] + [10.0 + 0.25 * i for i in range(9)]) == pytest.approx(0.25)
    assert steady_step_s([1.0] * 6) is None
    # a recompile (a new padded shape) stands apart from the usual steps: 2 warm-up steps left out, then
    # 0.2 s steps with one of 10 s
    ends = [0.0, 12.0, 20.0] + [20.0 + 0.2 * i for i in range(1, 5)] + [30.8] + [30.8 + 0.2 * i for i in range(1, 4)]
    summary = step_time_summary(ends)
    assert summary["timed_steps"] == 8 and summary["slow_steps"] == 1
    assert summary["step_s_median"] == pytest.approx(0.2) and summary["step_s_without_slow"] == pytest.approx(0.2)
    assert summary["step_s_mean"] == pytest.approx((7 * 0.2 + 10.0) / 8)
    assert step_time_summary([1.0, 2.0, 3.0]) == {}

    # its batches counted: real tokens from the attention mask, supervised ones from loss_mask, else labels
    from bench.peers.peer_modelopt_run import count_batch

    counts = {"real": None, "padded": 0, "loss": None}
    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    count_batch(counts, {"attention_mask": attention, "loss_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])})
    count_batch(counts, {"attention_mask": attention, "labels": torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, -100]])})
    assert (int(counts["real"]), counts["padded"], int(counts["loss"])) == (10, 16, 6)

    from drafter_helpers import tiny_drafter
    from bench.peers.peer_modelopt_run import load_draft_weights
    from safetensors.torch import load_file, save_file

    from dflash_trainer.drafter.export import export_drafter

    (source, _), (module, _) = tiny_drafter(seed=0), tiny_drafter(seed=1)
    module.register_buffer("rotary_emb_inv_freq", torch.ones(2))  # a buffer the file lacks, as the peer's rotary
    weights = export_drafter(source, tmp_path / "init") / "model.safetensors"
    peer = SimpleNamespace(dflash_module=module)
    assert load_draft_weights(peer, weights) == len(load_file(str(weights)))
    for name, p in source.state_dict().items():
        assert torch.equal(module.state_dict()[name], p), name
    state = load_file(str(weights))
    fc = state.pop("fc.weight")
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(SystemExit, match="missing \\['fc.weight'\\]"):
        load_draft_weights(peer, tmp_path / "missing.safetensors")
    save_file(state | {"fc.weight": fc[:, :-1].contiguous()}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(SystemExit, match="fc.weight"):
        load_draft_weights(peer, tmp_path / "shape.safetensors")
    # a DSpark draft module takes the DFlash layout's backbone; its Markov head keeps the peer's initialisation
    import dataclasses

    from dflash_trainer.drafter.model import DFlashDrafter

    dspark = DFlashDrafter(dataclasses.replace(source.spec, variant="dspark", markov_rank=4))
    # the peer's module names its head flat (`markov_w1`, `markov_w2`), as ModelOpt 0.47 does; ours nests it
    dspark.markov_w1, dspark.markov_w2 = dspark.markov_head.markov_w1, dspark.markov_head.markov_w2
    del dspark.markov_head
    head = dspark.markov_w2.weight.clone()
    assert load_draft_weights(SimpleNamespace(dflash_module=dspark), weights) == len(load_file(str(weights)))
    assert torch.equal(dspark.fc.weight, source.fc.weight) and torch.equal(dspark.markov_w2.weight, head)


def test_curve_tables_and_draws_the_runs_by_training_set(tmp_path):
    def result(name, rows, minutes, tau, evals=()):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "commit": "abc1234", "data": {"train_rows": rows},
                                    "train_loop_s": minutes * 60, "budget_minutes": minutes, "tau": tau,
                                    "prompt_lookup_tau": 2.0, "steps": 3000, "evals": list(evals)}))
        return str(path)

    during = [{"step": 1000, "eval_tau": 3.2, "eval_prompt_lookup_tau": 2.0},  # 1/3 of the run's steps
              {"step": 3000, "eval_tau": 3.6, "eval_prompt_lookup_tau": 2.0}]  # the end: not a second point
    no_lookup = [{"step": 1500, "eval_tau": 3.1, "eval_prompt_lookup_tau": None}]  # eval.prompt_lookup=false
    files = [result("a5", 100, 5, 3.0), result("a15", 100, 15, 3.6, during), result("b5", 300, 5, 3.3),
             result("b15", 300, 15, 3.7, no_lookup)]
    png = tmp_path / "curve.png"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "curve.py"), *files, "--regen", "100=1.5",
                           "--out", str(png)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 100 | a15 | abc1234 | 15.0 | 16.5 | 3.60 | 2.00 | 1.80x |" in proc.stdout
    assert "| 300 | b5 | abc1234 | 5.0 | 5.0 + regeneration | 3.30 | 2.00 | 1.65x |" in proc.stdout
    assert "| 100 | a15 (at step 1,000) | abc1234 | 5.0 | 6.5 | 3.20 | 2.00 | 1.60x |" in proc.stdout
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "| 300 | b15 (at step 1,500) | abc1234 | 7.5 | 7.5 + regeneration | 3.10 | - | -x |" in proc.stdout
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])["points"]) == 6
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "curve.py"), *files, "--label", "many=x"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--label 'many=x': expected ROWS=TEXT" in bad.stderr


def test_compare_pairs_the_prompts_and_refuses_other_prompts(tmp_path):
    def result(name, committed, digest="d1", **extra):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "tau": sum(committed) / (10 * len(committed)),
                                    "per_prompt_committed": committed, "per_prompt_steps": [10] * len(committed),
                                    "setting_digest": digest, **extra}))
        return str(path)

    base = result("base", [30, 20, 50, 10])  # taus 3, 2, 5, 1: prompts differ a lot
    better = result("better", [34, 21, 56, 13])  # +0.4, +0.1, +0.6, +0.3 on the same prompts

    def run(*files):
        return subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "compare.py"), *files], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)

    proc = run(base, better)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}
    assert rows["better"]["difference"] == pytest.approx(0.35)
    # equal steps per prompt: the standard error of the mean of the per-prompt gains
    gains = [0.4, 0.1, 0.6, 0.3]
    reference = (sum((g - 0.35) ** 2 for g in gains) / 3 / 4) ** 0.5
    assert rows["better"]["difference_stderr"] == pytest.approx(reference)
    assert rows["better"]["difference_stderr"] < rows["better"]["stderr"] / 5
    assert "| better | 3.100 ± " in proc.stdout and "| +0.350 |" in proc.stdout
    # the first N prompts only, with prompt lookup's tau on them when a result kept its per-prompt counts
    lookup = result("lookup", [30, 20, 50, 10], prompt_lookup_per_prompt_committed=[20, 20, 30, 10],
                    prompt_lookup_per_prompt_steps=[10] * 4)
    first = run(base, better, lookup, "--first", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    last = json.loads(first.stdout.strip().splitlines()[-1])
    assert last["prompts"] == 2 and last["prompt_lookup"]["tau"] == pytest.approx(2.0)
    rows2 = {r["name"]: r for r in last["rows"]}
    assert rows2["base"]["tau"] == pytest.approx(2.5) and rows2["better"]["tau"] == pytest.approx(2.75)
    assert rows2["better"]["difference"] == pytest.approx(0.25)
    assert rows2["better"]["lookup_ratio"] == pytest.approx(1.375)
    assert "| 1.38x |" in first.stdout and "prompt lookup on the same prompts: 2.000" in first.stdout
    assert rows["better"]["lookup_ratio"] is None  # no result kept prompt lookup's counts
    too_many = run(base, better, "--first", "5")
    assert too_many.returncode != 0 and "--first 5" in too_many.stderr and "has 4 prompts" in too_many.stderr
    other = run(base, result("other", [30, 20, 50, 10], digest="d2"))
    assert other.returncode != 0 and "other.json was evaluated otherwise than" in other.stderr
    # another digest (the target in another folder) with prompt lookup's counts equal on every prompt: compared,
    # and said; one prompt's lookup count apart: refused
    moved = result("moved", [34, 21, 56, 13], digest="d3", prompt_lookup_per_prompt_committed=[20, 20, 30, 10],
                   prompt_lookup_per_prompt_steps=[10] * 4)
    paired = run(lookup, moved)
    assert paired.returncode == 0 and "prompt lookup's counts agree on all 4 prompts" in paired.stderr
    apart = result("apart", [34, 21, 56, 13], digest="d3", prompt_lookup_per_prompt_committed=[20, 20, 30, 11],
                   prompt_lookup_per_prompt_steps=[10] * 4)
    assert run(lookup, apart).returncode != 0
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"name": "old", "tau": 3.0}))
    missing = run(base, str(old))
    assert missing.returncode != 0 and "no per_prompt_committed, per_prompt_steps, setting_digest" in missing.stderr
    # eval.json files carry no name: a run's folder names it, a copy its own file name
    unnamed = {k: v for k, v in json.loads(Path(better).read_text()).items() if k != "name"}
    for relative, expected in (("eval-alone-arm/eval.json", "eval-alone-arm"), ("results/arm-copy.json", "arm-copy")):
        path = tmp_path / relative
        path.parent.mkdir()
        path.write_text(json.dumps(unnamed))
        named = run(base, str(path))
        assert named.returncode == 0, named.stderr[-2000:]
        assert json.loads(named.stdout.strip().splitlines()[-1])["rows"][1]["name"] == expected


@pytest.mark.parametrize("arms", sorted(p.name for p in (ROOT / "bench" / "quality" / "arms").glob("*.txt")))
def test_arms_files_are_valid_practice_configs(arms):
    """An arm with a misspelt key or a value its config refuses would fail only on the device, after its data."""
    runs = read_arms(ROOT / "bench" / "quality" / "arms" / arms)
    assert runs and len({name for name, *_ in runs}) == len(runs), f"{arms}: no arms, or two of one name"
    for name, *overrides in runs:
        load_config(ROOT / "configs" / "practice.yaml", overrides)  # raises ConfigError naming the bad override


@pytest.mark.parametrize("cells", sorted(p.name for p in (ROOT / "bench" / "peers" / "cells").glob("*.txt")))
def test_cells_files_are_valid_peer_options(cells):
    """A peer cell ("NAME option ...", as bench/peers/peer_cells.sh runs it) whose option bench/peers/peers.py refuses
    would fail only on the device."""
    from bench.peers.peers import parser

    lines = [line.split(maxsplit=1) for line in (ROOT / "bench" / "peers" / "cells" / cells).read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and len({name for name, *_ in lines}) == len(lines), f"{cells}: no cells, or two of one name"
    for name, *options in lines:
        args = parser().parse_args(["modelopt", *" ".join(options).split()])  # exits 2 on a bad option
        assert args.max_steps > 0 or args.minutes > 0, name


@pytest.mark.parametrize("suite", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.sh")))
def test_device_suites_parse(suite):
    """The suites run only on the device machine, whose time is scarce: a syntax error is caught here first."""
    proc = subprocess.run(["bash", "-n", str(ROOT / suite)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_run_suite_brings_back_the_scripts_json_and_log(tmp_path):
    """bench/run.sh runs one bench script with its arguments and packs its JSON and log into
    $OUT/results.tar.gz, passing the script's exit status on."""
    import tarfile

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "SUITE_TMP": str(tmp_path / "suite"), "LIMIT_S": "120"}
    suite = str(ROOT / "bench" / "run.sh")
    proc = subprocess.run(["bash", suite, "bench/speed/run.py", "--smoke"], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = tar.getnames()
        assert "suite-logs/run.log" in names, names
        (result,) = [n for n in names if n.startswith("suite-results/") and n.endswith("-run-tiny-mfu.json")]
        assert json.load(tar.extractfile(result))["status"] == "ok"
    failed = subprocess.run(["bash", suite, "bench/speed/run.py", "--no-such-option"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert failed.returncode == 2, failed.stdout[-2000:]


def test_held_out_prompts_leave_out_those_the_training_records_also_hold():
    """bench/quality/quality.py's split: a held-out record whose user turn (up to case and whitespace) is also a training
    record's user turn is not an evaluation prompt; records open at their first user turn."""
    from dflash_trainer.data.types import Conversation, Message

    def conv(index, *turns):
        roles = ["assistant"] + ["user", "assistant"] * len(turns) if index == 0 else ["user", "assistant"] * len(turns)
        texts = ["hello"] + [t for turn in turns for t in (turn, "reply")] if index == 0 else \
            [t for turn in turns for t in (turn, "reply")]
        return Conversation(messages=tuple(Message(role=r, content=t) for r, t in zip(roles, texts)),
                            source="s", source_index=index)

    records = [conv(0, "Write a poem", "Shorter"), conv(1, "What is 2+2?"),
               conv(2, "  write A   poem "), conv(3, "Explain gravity"), conv(4, "Name a color", "shorter"),
               conv(5, "Tell a joke")]
    train, evals = split_conversations(records, first_held=2, num_eval=10)
    assert [c.source_index for c in train] == [0, 1] and train[0].messages[0].role == "user"
    assert [c.source_index for c in evals] == [3, 4, 5]  # 2 repeats record 0's first turn
    _, two_turns = split_conversations(records, first_held=2, num_eval=10, eval_turns=2)
    assert two_turns == []  # record 4's second turn is record 0's second turn; no other has two
    _, first = split_conversations(records, first_held=2, num_eval=2)
    assert [c.source_index for c in first] == [3, 4]


def test_specforge_loader_gives_exactly_n_batches_over_passes_and_records_them(tmp_path):
    """peer_specforge_run.py's step cap: the peer's training loader walked as exactly N batches, a new shuffle
    each pass over the data, the real/padded/loss tokens of what it yielded recorded, and no second walk."""
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.peers.peer_specforge_run import StepCappedLoader

    rows = [{"index": torch.tensor(i), "attention_mask": torch.tensor([1] * (2 + i % 3) + [0] * (3 - i % 3)),
             "loss_mask": torch.tensor([0, 1, 1, 0, 0])} for i in range(5)]
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(rows, batch_size=2, sampler=sampler)  # 3 batches a pass
    stats = tmp_path / "stats.json"
    capped = StepCappedLoader(loader, 7, stats)
    assert len(capped) == 7
    batches = list(capped)
    assert len(batches) == 7  # 3 + 3 + 1: three passes
    order = [int(i) for b in batches for i in b["index"]]
    assert sorted(order[:5]) == sorted(order[5:10]) == list(range(5)) and order[:5] != order[5:10]
    recorded = json.loads(stats.read_text())
    assert recorded["steps"] == 7 and recorded["data_passes"] == 3 and len(recorded["step_ends_s"]) == 7
    assert recorded["real_tokens"] == sum(int(b["attention_mask"].sum()) for b in batches)
    assert recorded["padded_tokens"] == 5 * sum(b["index"].numel() for b in batches)
    assert recorded["loss_tokens"] == 2 * sum(b["index"].numel() for b in batches)
    with pytest.raises(SystemExit, match="walked twice"):
        list(capped)


def test_specforge_draft_config_is_the_targets_with_our_drafter_shape(tmp_path):
    """peer_specforge.py's draft config: the target's sizes, our depth, taps and block, a mask id it checks."""
    from bench.peers.peer_specforge import draft_config

    from dflash_trainer.target.checks import choose_tap_layer_ids

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 8192, "num_hidden_layers": 6, "hidden_size": 256, "head_dim": 32,
        "layer_types": ["full_attention"] * 6, "transformers_version": "5.0"}))
    config = draft_config(tmp_path, num_layers=5, block_size=16, mask_token_id=5)
    assert config["num_hidden_layers"] == 5 and len(config["layer_types"]) == 5 and config["hidden_size"] == 256
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": choose_tap_layer_ids(6, 5)}
    assert config["block_size"] == 16 and config["num_target_layers"] == 6 and "transformers_version" not in config
    with pytest.raises(SystemExit, match="not below the target's vocabulary"):
        draft_config(tmp_path, num_layers=5, block_size=16, mask_token_id=8192)


def test_long_context_figure_tables_each_series_by_length(tmp_path):
    """bench/long_context/long_context_figure.py: drafter-alone points of each mode and whole-step points of one long sequence
    (not batches of several, nor short ones) in one table, sorted by series and length, and a figure."""
    from bench.long_context.long_context_figure import main as figure_main
    from bench.long_context.long_context_figure import points

    alone = {"bench": "long_context", "model": "qwen3-8b", "commit": "abc1234", "results": [
        {"length": 131072, "mode": "chunked", "peak_gpu_mem_gb": 90.0, "step_ms": 9000.0, "tokens_per_s": 14563.0,
         "mfu": 0.5, "plan": "4 chunks"},
        {"length": 32768, "mode": "chunked", "peak_gpu_mem_gb": 60.0, "step_ms": 2500.0, "tokens_per_s": 13107.0,
         "mfu": 0.56, "plan": "2 chunks"},
        {"length": 131072, "mode": "one-pass", "peak_gpu_mem_gb": None, "step_ms": None, "status": "OOM"}]}

    def run(length, seqs):
        return {"bench": "run", "model": "qwen3-8b", "status": "ok", "commit": "abc1234", "tokens_per_step": length,
                "workload_note": f"{seqs} sequences of exactly {length // seqs} tokens per batch",
                "compile_target": False, "peak_gpu_mem_gb": 83.6, "step_ms": 37674.0, "tokens_per_s": 3479.0,
                "mfu": 0.525, "target_mfu": 0.663, "drafter_step_mfu": 0.457}

    files = []
    for name, result in (("a.json", alone), ("b.json", run(131072, 1)), ("c.json", run(16384, 4)),
                         ("d.json", run(4096, 1)), ("e.json", alone | {"model": "qwen3-1.7b"})):
        (tmp_path / name).write_text(json.dumps(result))
        files.append(tmp_path / name)
    rows = points(files, "qwen3-8b", min_length=16384)
    assert [(r["series"], r["length"]) for r in rows] == [
        ("drafter step, chunked", 32768), ("drafter step, chunked", 131072), ("whole step (target eager)", 131072)]
    out = tmp_path / "fig.png"
    assert figure_main([*map(str, files), "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def test_compare_by_seeds_gives_the_difference_of_means_with_its_seed_level_error(tmp_path):
    def result(name, committed):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "per_prompt_committed": committed,
                                    "per_prompt_steps": [10] * len(committed), "setting_digest": "d"}))
        return str(path)

    base = [result(f"a-s{s}", c) for s, c in enumerate(([20, 30], [22, 30], [24, 30]))]  # taus 2.5, 2.6, 2.7
    other = [result(f"b-s{s}", c) for s, c in enumerate(([30, 30], [30, 30], [36, 30]))]  # taus 3.0, 3.0, 3.3
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "compare.py"), "--seeds", "3", *base,
                           *other], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    arms = {a["name"]: a for a in json.loads(proc.stdout.strip().splitlines()[-1])["arms"]}
    b = arms["b-s0"]
    assert b["taus"] == pytest.approx([3.0, 3.0, 3.3]) and b["mean"] == pytest.approx(3.1)
    assert b["differences"] == pytest.approx([0.5, 0.4, 0.6]) and b["difference"] == pytest.approx(0.5)
    assert b["seed_error"] == pytest.approx(0.1 / 3 ** 0.5)  # sd of (0.5, 0.4, 0.6) over sqrt(3)
    assert arms["a-s0"]["sd"] == pytest.approx(0.1)
    assert "| b-s0 | 3.000 / 3.000 / 3.300 | 3.100 (0.173) | +0.500 | 0.058 |" in proc.stdout
    odd = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "compare.py"), "--seeds", "4", *base,
                          *other], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert odd.returncode != 0 and "--seeds 4: give two or more arms of 4 results each (6 given)" in odd.stderr


@pytest.mark.parametrize("verdict", [{"ok": True, "flash_vs_triton": 1e-3, "triton_vs_fp32": 2e-3, "flash_vs_fp32": 2e-3},
                                     {"ok": False, "failure": "the flash backend did not run the drafter's attention"}])
def test_fa4_check_saves_its_verdict(tmp_path, monkeypatch, capsys, verdict):
    """The FA4 agreement check (a GPU-only run) writes what it printed as a result JSON, failures included."""
    from bench.long_context import fa4_check

    monkeypatch.setattr(fa4_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa4_check.torch.cuda, "get_device_name", lambda: "test GPU")
    monkeypatch.setattr(fa4_check, "check", lambda args: verdict)
    monkeypatch.setattr(sys, "argv", ["fa4_check.py", "--out", str(tmp_path)])
    assert fa4_check.main() == (0 if verdict["ok"] else 1)
    saved = json.loads(next(tmp_path.glob("*-long_context-fa4_check.json")).read_text())
    assert {k: saved[k] for k in verdict} == verdict and saved["gpu"] == "test GPU" and saved["seq_len"] == 4096
    assert ("OK:" if verdict["ok"] else "FAIL: the flash backend") in capsys.readouterr().out


def test_a_peer_run_that_fails_is_saved_as_a_result(tmp_path, monkeypatch):
    """A setting the peer cannot run (out of memory at the 8B shape) leaves a JSON saying so, not only a log."""
    from bench.peers import peers

    log = tmp_path / "timed.log"
    log.write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB\n")

    def fails(args):
        raise peers.PeerRunFailed("timed", 1, log)

    monkeypatch.setattr(peers, "modelopt", fails)
    rc = peers.main(["modelopt", "--target", str(tmp_path), "--results", str(tmp_path / "results"), "--name",
                     "b8-a512", "--batch", "8", "--max-steps", "30"])
    assert rc == 1
    saved = json.loads(next((tmp_path / "results").glob("*-peers-b8-a512.json")).read_text())
    assert saved["status"] == "failed" and saved["out_of_memory"] is True and saved["batch"] == 8
    assert "Tried to allocate" in saved["log_tail"]


def test_curve_evaluates_each_run_when_it_ends_and_the_rest_when_training_ends(tmp_path):
    """bench/quality/curve.sh (PHASE=wait): a run whose result JSON is written is evaluated alone while the others still
    train; the runs left are evaluated once the training ends; every evaluation comes back in results.tar.gz."""
    import signal
    import tarfile

    w = tmp_path / "curve"
    for name in ("early", "late"):
        (w / "runs" / name / "export").mkdir(parents=True)
    (w / "results").mkdir()
    (w / "results" / "2026-01-01T000000-quality-early.json").write_text("{}")  # `early` ended, `late` trains on
    (w / "cache").mkdir()
    (w / "cache" / "eval.jsonl").write_text('{"p": 1}\n{"p": 2}\n')
    (w / "train.log").write_text("")
    # the training: in its own session and no child of this process (a child would linger as a zombie until reaped)
    pid = int(subprocess.run(["bash", "-c", "setsid sleep 6 > /dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True, check=True).stdout)
    (w / "train.pid").write_text(str(pid))
    calls = tmp_path / "evals.log"
    stub = tmp_path / "bin"
    stub.mkdir()
    # python3 as the suite calls it: `-m dflash_trainer eval ... --out DIR` writes DIR/eval.json and logs the call with
    # whether the training still ran; anything else goes to this interpreter
    (stub / "python3").write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m dflash_trainer eval" ]; then
  out=$(echo "$@" | sed 's/.*--out \\([^ ]*\\).*/\\1/')
  running=$(kill -0 {pid} 2>/dev/null && echo training || echo ended)
  echo "$(basename "$out") $running" >> {calls}
  mkdir -p "$out" && echo '{{"tau": 1.5}}' > "$out/eval.json"
  exit 0
fi
exec {sys.executable} "$@"
""")
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "SUITE_TMP": str(tmp_path / "suite"), "CURVE_DIR": str(w), "PHASE": "wait", "FOLLOW_S": "1",
           "DEADLINE_S": "120", "EVAL_PARALLEL": "1", "DEVICE": "cpu"}
    try:
        proc = subprocess.run(["bash", str(ROOT / "bench" / "quality" / "curve.sh")], capture_output=True, text=True,
                              env=env, timeout=90)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert calls.read_text().split("\n")[:2] == ["eval-alone-early training", "eval-alone-late ended"], \
        calls.read_text()
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = tar.getnames()
    for name in ("early", "late"):
        assert f"suite-results/eval-alone-{name}/eval.json" in names, names
