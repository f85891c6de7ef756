"""`train.optimizer=muon`: our Muon steps as torch.optim.Muon does; the parameters go where they should (matrices to
Muon, vocabulary tables to AdamW at Muon's lr, the rest to AdamW) on DFlash, DFlash2, DSpark and a module we have not
written; the schedule drives every group; FSDP2-sharded matrices step exactly as whole ones; a resumed run continues
bit for bit; data-parallel ranks split the orthogonalisations and step exactly as one rank."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from drafter_helpers import tiny_drafter
from pipeline_helpers import assert_ok, checkpoints, committed_jobs, metrics, planned_jobs, torchrun, train_in_process
from safetensors.torch import load_file
from spawn_helpers import free_port, leave_spawned_rank
from torch import nn

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.errors import ConfigError
from dflash_trainer.train.config import TrainConfig
from dflash_trainer.train import muon
from dflash_trainer.train.muon import Muon, MuonAdamW, deal_owners, ns_flops, orthogonalize, route_parameters
from dflash_trainer.train.optim import build_optimizer
from dflash_trainer.train.schedule import build_scheduler, lr_factor

MUON = TrainConfig(optimizer="muon", lr=1e-3, weight_decay=0.01)


def _routes(model: nn.Module, vocab_size: int) -> dict[str, set[str]]:
    return {k: {n for n, _ in v} for k, v in route_parameters(model, vocab_size).items()}


def test_our_muon_steps_as_torch_muon_does():
    """torch.optim.Muon with Moonshot's lr scaling is the reference: the same weights after steps of random gradients,
    tall, wide and square matrices, weight decay on."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(shape)) for shape in ((6, 9), (11, 4), (5, 5))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    opt = Muon(ours, lr=0.05, weight_decay=0.1, momentum=0.9)
    ref_opt = torch.optim.Muon(ref, lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q, p0 in zip(ours, ref, start):
        assert torch.equal(p, q)
        assert not torch.allclose(p, p0, atol=1e-3)  # they moved


def test_orthogonalize_brings_singular_values_near_one():
    m = torch.linalg.qr(torch.randn(32, 12)).Q @ torch.diag(torch.logspace(-1, 0, 12))  # singular values 0.1..1
    s = torch.linalg.svdvals(orthogonalize(m).float())
    assert s.min() > 0.5 and s.max() < 1.3, s


def test_muon_refuses_other_than_matrices():
    with pytest.raises(ValueError, match=r"2-D matrices only.*\(4,\)"):
        Muon([nn.Parameter(torch.ones(4))], lr=0.1)


def test_dflash_matrices_go_to_muon_norms_to_adamw():
    model, _ = tiny_drafter(num_layers=1)
    routes = _routes(model, model.spec.vocab_size)
    assert routes["tables"] == set()
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= routes["muon"]
    assert all(model.get_parameter(n).ndim == 2 for n in routes["muon"])
    assert routes["adamw"] == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert sum(len(v) for v in routes.values()) == len(list(model.parameters()))


def test_dflash2_codebooks_are_tables_and_conv_kernels_adamw():
    model, _ = tiny_drafter(num_layers=1, variant="dflash2")
    routes = _routes(model, model.spec.vocab_size)
    assert routes["tables"] == {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}
    assert {"candidate_selector.hidden_projection.weight", "layers.0.mlp_conv.kernel_projection.weight"} <= routes["muon"]
    assert "layers.0.mlp_conv.base_kernel" in routes["adamw"]  # 3-D


def test_dspark_markov_factors_are_tables():
    base, _ = tiny_drafter(num_layers=1)
    model = DFlashDrafter(dataclasses.replace(base.spec, variant="dspark", markov_rank=4))
    routes = _routes(model, model.spec.vocab_size)
    assert routes["tables"] == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}


class _Unseen(nn.Module):
    """A variant we have not seen: a (V, r) table as a bare parameter, a vocabulary bias, an embedding of another
    size, a degenerate matrix and a hidden matrix."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, 3))
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.positions = nn.Embedding(7, 3)
        self.gate = nn.Parameter(torch.randn(1, 8))
        self.hidden = nn.Linear(8, 3, bias=False)
        self.frozen = nn.Parameter(torch.randn(8, 8), requires_grad=False)


def test_an_unseen_variants_vocabulary_tables_and_embeddings_stay_out_of_muon():
    routes = _routes(_Unseen(), vocab_size=50)
    assert routes == {"tables": {"table", "bias", "positions.weight"}, "muon": {"hidden.weight"}, "adamw": {"gate"}}


def test_groups_lrs_and_the_schedule_drive_every_group(caplog):
    model, _ = tiny_drafter(num_layers=1, variant="dflash2")
    with caplog.at_level(logging.INFO, logger="dflash_trainer.train.optim"):
        opt = build_optimizer(model, MUON, vocab_size=model.spec.vocab_size)
    assert isinstance(opt, MuonAdamW)
    said = [r.getMessage() for r in caplog.records]
    table_size = 2 * model.spec.vocab_size * model.spec.selector_rank
    assert len(said) == 1 and said[0].startswith("train.optimizer=muon: Muon at lr 0.01: 11 matrices ("), said
    assert (f"AdamW at Muon's lr 0.01: 2 vocabulary tables ({table_size:,} parameters: candidate_selector."
            "predecessor_codebook, candidate_selector.successor_codebook); AdamW at lr 0.001: 8 others") in said[0]
    by_kind = {}
    for g in opt.param_groups:
        by_kind.setdefault((g["optimizer"], g["lr"]), set()).update(id(p) for p in g["params"])
    selector = model.candidate_selector
    codebooks = {id(selector.predecessor_codebook), id(selector.successor_codebook)}
    assert by_kind[("adamw", 1e-2)] == codebooks  # tables: AdamW at Muon's lr (10 x train.lr)
    assert id(model.fc.weight) in by_kind[("muon", 1e-2)]
    assert id(model.norm.weight) in by_kind[("adamw", 1e-3)]
    assert opt.param_groups[0]["lr"] == MUON.lr  # AdamW first: the lr logged each step is train.lr's
    decays = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays[id(model.norm.weight)] == 0.0 and decays[id(model.fc.weight)] == 0.01

    peaks = [g["lr"] for g in opt.param_groups]
    sched = build_scheduler(opt, total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)
    for step in range(6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
        f = lr_factor(step + 1, total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([f * peak for peak in peaks])
        assert [g["lr"] for part in opt.parts.values() for g in part.param_groups] == [g["lr"] for g in opt.param_groups]


def test_muon_settings_are_validated():
    assert TrainConfig(optimizer="muon", lr=2e-4).muon_peak_lr == pytest.approx(2e-3)
    assert TrainConfig(optimizer="muon", muon_lr=5e-3).muon_table_peak_lr == 5e-3
    assert TrainConfig(optimizer="muon", muon_table_lr=1e-4).muon_table_peak_lr == 1e-4
    with pytest.raises(ConfigError, match=r"train.optimizer must be one of adamw, muon, got 'sgd'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match=r"train.muon_lr=0.01 is read only with train.optimizer=muon"):
        TrainConfig(muon_lr=0.01)
    with pytest.raises(ConfigError, match=r"train.muon_table_lr must be a finite number > 0"):
        TrainConfig(optimizer="muon", muon_table_lr=float("nan"))
    with pytest.raises(ConfigError, match=r"train.muon_momentum must be in \[0, 1\)"):
        TrainConfig(optimizer="muon", muon_momentum=1.0)


def test_a_muon_state_dict_restores_both_parts():
    """A twin loaded from the state dict after 2 steps then steps as the original does: both parts' state (Adam
    moments and steps, Muon momentum) and groups came back and reach the parts."""
    model, _ = tiny_drafter(num_layers=1, variant="dflash2")
    opt = build_optimizer(model, MUON, vocab_size=model.spec.vocab_size)
    gen = torch.Generator().manual_seed(3)

    def step(m, o):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        o.step()

    step(model, opt)
    step(model, opt)
    twin_model, _ = tiny_drafter(num_layers=1, variant="dflash2")
    twin_model.load_state_dict(model.state_dict())
    twin = build_optimizer(twin_model, MUON, vocab_size=model.spec.vocab_size)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy, as a checkpoint holds: no shared tensors
    assert twin.parts["muon"].param_groups[0] is twin.param_groups[-1] and twin.parts["muon"].state is twin.state
    seed = gen.initial_seed()
    gen.manual_seed(seed)
    step(model, opt)
    gen.manual_seed(seed)
    step(twin_model, twin)
    for (name, p), q in zip(model.named_parameters(), twin_model.parameters()):
        assert torch.equal(p, q), name


def _gloo_rank(rank: int, body, world: int, port: int) -> None:
    """One spawned rank: joins a gloo group, runs `body(rank, world)`, and leaves (`leave_spawned_rank`); a failure
    raises, and mp.spawn reports it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_spawned_rank()


def _sharded_equals_whole(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dflash_trainer.train.parallel import full_optimizer_state, full_weights, load_full_state

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))  # 3 rows: shards of 2, 1
    sharded = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    sharded.load_state_dict(whole.state_dict())
    fully_shard(sharded, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    # the sharded one splits its orthogonalisations over the ranks
    opts = [build_optimizer(m, MUON, vocab_size=1000, group=g) for m, g in ((whole, None), (sharded, dist.group.WORLD))]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    for _ in range(3):
        for model, opt in zip((whole, sharded), opts):
            opt.zero_grad()
            model(x).square().sum().backward()  # sharded: the mean over ranks of equal gradients, exact
            opt.step()
    got = full_weights(sharded)
    for name, want in whole.state_dict().items():
        assert torch.equal(got[name], want), name
    # the gathered state (by parameter name) loads into a whole model: momentum equal to the whole run's
    state = full_optimizer_state(sharded, opts[1])
    plain = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    plain_opt = build_optimizer(plain, MUON, vocab_size=1000)
    load_full_state(plain, plain_opt, got, state)
    for p, q in zip(plain.parameters(), whole.parameters()):
        key = "momentum_buffer" if p.ndim == 2 else "exp_avg"
        assert torch.equal(plain_opt.state[p][key], opts[0].state[q][key])
    # and into a freshly sharded one, which then steps on as the whole run does (a sharded resume)
    again = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    fully_shard(again, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    again_opt = build_optimizer(again, MUON, vocab_size=1000, group=dist.group.WORLD)
    load_full_state(again, again_opt, got, state)
    for model, opt in ((whole, opts[0]), (again, again_opt)):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    got = full_weights(again)
    for name, want in whole.state_dict().items():
        assert torch.equal(got[name], want), name


def test_fsdp_sharded_matrices_step_exactly_as_whole_ones():
    mp.spawn(_gloo_rank, args=(_sharded_equals_whole, 2, free_port()), nprocs=2, join=True)


SHAPES = ((6, 9), (11, 4), (5, 5), (8, 8), (3, 12), (7, 2))


def _split_equals_one_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same weights and gradients on every rank (as after the gradients' all-reduce)
    muon.IN_FLIGHT_BYTES = 200  # a result or two held at a time: the oldest are handed out mid-list
    split = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    alone = [nn.Parameter(p.detach().clone()) for p in split]
    opts = Muon(split, lr=0.05, weight_decay=0.1, group=dist.group.WORLD), Muon(alone, lr=0.05, weight_decay=0.1)
    calls = {"n": 0}
    plain = muon.orthogonalize

    def counted(matrix):
        calls["n"] += 1
        return plain(matrix)

    muon.orthogonalize = counted
    for _ in range(3):
        for p, q in zip(split, alone):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opts[0].step()
        split_calls = calls["n"]
        opts[1].step()
        calls["n"] = split_calls
    muon.orthogonalize = plain
    for p, q in zip(split, alone):
        assert torch.equal(p, q)
    counts = [None] * world
    dist.all_gather_object(counts, calls["n"])
    assert sum(counts) == 3 * len(SHAPES) and max(counts) < 3 * len(SHAPES), counts  # each matrix once, shared


def test_data_parallel_ranks_split_the_orthogonalisations_and_step_as_one_rank():
    mp.spawn(_gloo_rank, args=(_split_equals_one_rank, 2, free_port()), nprocs=2, join=True)


def test_matrices_are_dealt_by_their_newton_schulz_flops():
    shapes = [torch.Size(s) for s in ((4096, 12288), (12288, 4096), (4096, 4096), (1024, 4096), (4096, 4096),
                                      (1024, 4096), (4096, 20480))]
    owners = deal_owners(shapes, 3)
    assert owners == deal_owners(shapes, 3) and set(owners) == {0, 1, 2}
    load = [sum(ns_flops(s) for s, o in zip(shapes, owners) if o == r) for r in range(3)]
    assert max(load) <= ns_flops(shapes[-1]) + min(load), load  # no rank more than the largest matrix above another
    assert deal_owners(shapes, 1) == [0] * len(shapes)
    assert ns_flops(torch.Size((3, 5))) == ns_flops(torch.Size((5, 3))) == 5 * 2 * (2 * 9 * 5 + 27)


RESUME = ("train.optimizer=muon", "drafter.variant=dflash2", "pipeline.deterministic=true", "train.grad_accum=1",
          "train.checkpoint_interval=4", "train.keep_last=100")


def test_a_resumed_muon_run_continues_bit_for_bit(tmp_path, capsys):
    """One run to the end; the same run resumed from its step-4 checkpoint: the same losses after step 4, and the
    same final weights, bit for bit."""
    run_dir = tmp_path / "run"
    assert train_in_process(run_dir, *RESUME) == 0
    first = [r for r in metrics(run_dir) if "jobs" in r]
    final = checkpoints(run_dir)[-1]
    weights = load_file(str(final / "drafter.safetensors"))
    assert len(first) > 6 and final.name == f"step_{first[-1]['step']}"

    step_4 = run_dir / "checkpoints" / "step_4"
    assert train_in_process(run_dir, *RESUME, f"train.resume={step_4}") == 0
    again = [r for r in metrics(run_dir) if "jobs" in r]
    assert [r["step"] for r in again] == [r["step"] for r in first]
    assert [(r["loss"], r["grad_norm"]) for r in again] == [(r["loss"], r["grad_norm"]) for r in first]
    resumed = load_file(str(checkpoints(run_dir)[-1] / "drafter.safetensors"))
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)

    # another optimizer is refused: given on resume, by the resume's config check; edited into the run's
    # config.yaml by hand, by the checkpoint's record of its optimizer
    assert train_in_process(run_dir, "train.optimizer=adamw", f"train.resume={step_4}") == 2
    assert "train.optimizer: 'muon' -> 'adamw' (given)" in capsys.readouterr().err
    config_yaml = run_dir / "config.yaml"
    assert "optimizer: muon" in config_yaml.read_text()
    config_yaml.write_text(config_yaml.read_text().replace("optimizer: muon", "optimizer: adamw"))
    assert train_in_process(run_dir, f"train.resume={step_4}") == 2
    assert ("was trained with train.optimizer=muon, the config asks for train.optimizer=adamw: resume with "
            "train.optimizer=muon") in capsys.readouterr().err


def test_two_drafter_ranks_train_with_split_orthogonalisations(tmp_path, monkeypatch):
    """Unsharded drafter ranks (their gradients averaged) split Muon's orthogonalisations in a real run: the ranks'
    broadcasts meet (no hang) and every job trains. That the split steps as one rank does, bit for bit:
    `test_data_parallel_ranks_split_the_orthogonalisations_and_step_as_one_rank`."""
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "train.fsdp=false",
                      "train.optimizer=muon", "train.checkpoint_interval=3")
    s = assert_ok(launch)
    assert "each of the 2 drafter ranks orthogonalises its share" in launch.output
    assert s["roles"] == ["target", "drafter", "drafter"] and s["status"] == "ok"
    assert sorted(committed_jobs(metrics(run_dir))) == sorted(planned_jobs(run_dir))
