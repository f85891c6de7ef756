"""The step loop normalises the loss over the whole step across ranks, skips NaN steps together and
ends together with uneven inputs (2 gloo ranks against a single-process reference)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import free_port, leave_spawned_rank

from dflash_trainer.train.step_loop import MicroResult, StepLoop

DIM = 4


def _batches():
    g = torch.Generator().manual_seed(7)
    # (epoch, job_id, x (n, DIM), y (n,)) with different sizes: the loss weight differs per batch
    return [(0, j, torch.randn(n, DIM, generator=g), torch.randn(n, generator=g)) for j, n in enumerate([3, 5, 2, 7, 4])]


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, 1, bias=False)


def _micro(model):
    def step(batch):
        _, _, x, y = batch
        if torch.isnan(x).any():
            loss_sum = torch.tensor(float("nan"), requires_grad=True)
        else:
            loss_sum = ((model(x).squeeze(-1) - y) ** 2).sum()
        loss_sum.backward()
        n = torch.tensor(float(x.shape[0]))
        return MicroResult(loss_sum=loss_sum.detach(), weight_sum=n, slot_correct=torch.zeros(1), slot_count=torch.ones(1), tau_sum=n * 0, num_blocks=n * 0 + 1, num_tokens=x.shape[0])

    return step


def _run(batches, group, grad_accum, sharded=False, time_budget_s=None):
    model = _model()
    dummy = None
    if sharded:
        from dflash_trainer.train.parallel import shard_drafter

        model.layers = torch.nn.ModuleList()  # the toy has no decoder layers: only the root is a unit
        shard_drafter(model, group, torch.device("cpu"))
        dummy = (0, -1, torch.zeros(1, DIM), torch.zeros(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loop = StepLoop(model=model, optimizer=opt, scheduler=sched, micro_step=_micro(model), job_key=lambda b: (b[0], b[1]),
                    grad_accum=grad_accum, block_size=2, grad_clip=0.0, group=group, device=torch.device("cpu"),
                    dummy_batch=dummy, time_budget_s=time_budget_s)
    queue = list(batches)
    records = []
    loop.run(lambda: (queue.pop(0), lambda: None) if queue else None, records.append)
    weight = model.weight.full_tensor() if sharded else model.weight
    return weight.detach().clone(), records, loop.state


def _worker(rank, port, shards, out_dir, sharded):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    weight, records, state = _run(shards[rank], dist.group.WORLD, grad_accum=2, sharded=sharded)
    torch.save({"weight": weight, "steps": state.step, "committed": state.committed, "skipped": state.skipped_steps,
                "losses": [r.loss for r in records]}, os.path.join(out_dir, f"r{rank}.pt"))
    dist.barrier()  # neither rank tears its connections down while the other still finishes the last collective
    leave_spawned_rank()


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp2"])
def test_two_ranks_equal_one_process_with_uneven_inputs(tmp_path, sharded):
    b = _batches()
    # Step 1: rank0 {0,1}, rank1 {2,3}; step 2 (partial): rank0 {4}, rank1 nothing (FSDP2: a dummy pass).
    shards = [[b[0], b[1], b[4]], [b[2], b[3]]]
    mp.start_processes(_worker, args=(free_port(), shards, str(tmp_path), sharded), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"r{i}.pt", weights_only=True) for i in range(2))
    ref_weight, ref_records, _ = _run([b[0], b[1], b[2], b[3], b[4]], None, grad_accum=4)
    torch.testing.assert_close(r0["weight"], r1["weight"])
    torch.testing.assert_close(r0["weight"], ref_weight)
    assert r0["steps"] == r1["steps"] == 2
    assert sorted(j for _, j in r0["committed"]) == [0, 1, 2, 3, 4]
    assert r0["losses"] == pytest.approx([ref_records[0].loss, ref_records[1].loss])


def test_nonfinite_step_is_skipped_and_counted():
    b = _batches()
    bad = (0, 9, torch.full((2, DIM), float("nan")), torch.zeros(2))
    weight, records, state = _run([b[0], bad, b[1], b[2]], None, grad_accum=2)
    assert [r.skipped for r in records] == [True, False]
    assert state.step == 1 and state.skipped_steps == 1
    assert sorted(j for _, j in state.committed) == [0, 1, 2, 9]
    ref, _, _ = _run([b[1], b[2]], None, grad_accum=2)
    torch.testing.assert_close(weight, ref)


def test_a_spent_time_budget_ends_the_run_after_the_current_step():
    b = _batches()
    weight, records, state = _run(b, None, grad_accum=2, time_budget_s=1e-9)
    assert len(records) == 1 and state.step == 1 and state.out_of_time
    assert sorted(j for _, j in state.committed) == [0, 1]  # the step's jobs are committed, the rest left
    ref, _, _ = _run(b[:2], None, grad_accum=2)
    torch.testing.assert_close(weight, ref)
    _, records, state = _run(b, None, grad_accum=2, time_budget_s=600.0)
    assert len(records) == 3 and not state.out_of_time and 0 < state.time_fraction < 0.1


def test_training_time_counts_earlier_sessions_and_leaves_pauses_out(monkeypatch):
    """A fake clock: each microbatch takes 10 s, an evaluation after each step 5 s (paused). With 30 s spent by an
    earlier session and a 100 s budget, the spent time reads 50, 70, 90, 110 and the fourth step is the last."""
    from types import SimpleNamespace

    from dflash_trainer.train import step_loop

    clock = [1000.0]
    monkeypatch.setattr(step_loop, "time", SimpleNamespace(monotonic=lambda: clock[0], perf_counter=lambda: clock[0]))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = _micro(model)

    def slow_micro(batch):
        clock[0] += 10.0
        return micro(batch)

    loop = StepLoop(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                    micro_step=slow_micro, job_key=lambda b: (b[0], b[1]), grad_accum=2, block_size=2, grad_clip=0.0,
                    group=None, device=torch.device("cpu"), time_budget_s=100.0, time_spent_s=30.0)
    queue = _batches() * 3
    spent = []

    def on_step(record):
        spent.append(loop.state.time_spent_s)
        clock[0] += 5.0  # an evaluation
        loop.pause(5.0)

    state = loop.run(lambda: (queue.pop(0), lambda: None) if queue else None, on_step)
    assert spent == pytest.approx([50.0, 70.0, 90.0, 110.0])
    assert state.step == 4 and state.out_of_time and state.time_fraction == pytest.approx(1.1)


@pytest.mark.parametrize("first_micro_s, warned", [(30.0, True), (5.0, False)])
def test_a_start_that_takes_much_of_the_time_budget_is_warned_about(monkeypatch, caplog, first_micro_s, warned):
    """A 100 s budget: a first step that ends 60 s in (two 30 s microbatches: compiling) is warned about, one
    that ends 10 s in is not; later slow steps are not a start."""
    import logging
    from types import SimpleNamespace

    from dflash_trainer.train import step_loop

    clock = [1000.0]
    monkeypatch.setattr(step_loop, "time", SimpleNamespace(monotonic=lambda: clock[0], perf_counter=lambda: clock[0]))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = _micro(model)
    calls = []

    def micro_step(batch):
        calls.append(1)
        clock[0] += first_micro_s if len(calls) <= 2 else 30.0
        return micro(batch)

    loop = StepLoop(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                    micro_step=micro_step, job_key=lambda b: (b[0], b[1]), grad_accum=2, block_size=2, grad_clip=0.0,
                    group=None, device=torch.device("cpu"), time_budget_s=100.0)
    queue = _batches() * 2
    with caplog.at_level(logging.WARNING, logger="dflash_trainer.train.step_loop"):
        loop.run(lambda: (queue.pop(0), lambda: None) if queue else None)
    messages = [r.getMessage() for r in caplog.records if "first step" in r.getMessage()]
    assert len(messages) == (1 if warned else 0)
    if warned:
        assert "60 s after the training loop started, 60% of the time budget" in messages[0]
        assert "train.max_minutes" in messages[0]


def _paused_worker(rank, port, out_dir):
    """Rank 0 evaluates (sleeps 0.3 s, paused) after the first step; rank 1 waits for it in the next step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = StepLoop(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                    micro_step=_micro(model), job_key=lambda b: (b[0], b[1]), grad_accum=1, block_size=2,
                    grad_clip=0.0, group=dist.group.WORLD, device=torch.device("cpu"), time_budget_s=600.0,
                    time_spent_s=5.0)
    queue = _batches()[rank::2]
    spent = []

    def on_step(record):
        spent.append(loop.state.time_spent_s)
        if rank == 0 and record.step == 1:
            time.sleep(0.3)
            loop.pause(0.3)

    loop.run(lambda: (queue.pop(0), lambda: None) if queue else None, on_step)
    torch.save({"spent": spent}, os.path.join(out_dir, f"t{rank}.pt"))
    dist.barrier()
    leave_spawned_rank()


def test_every_rank_reads_the_first_ranks_training_time_without_its_pauses(tmp_path):
    mp.start_processes(_paused_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    s0, s1 = (torch.load(tmp_path / f"t{i}.pt", weights_only=True)["spent"] for i in range(2))
    assert s0 == s1 and len(s0) == 3  # one value on every rank, step by step
    assert all(5.0 <= a <= b for a, b in zip(s0, s0[1:]))  # from the earlier sessions' 5 s on, never backwards
    assert s0[-1] < 5.0 + 0.25  # the 0.3 s evaluation is left out (each step takes milliseconds)


def test_schedule_follows_the_time_budget_when_it_runs_out_first():
    from dflash_trainer.train.schedule import build_scheduler, lr_factor

    spent = [0.0]
    opt = torch.optim.SGD(_model().parameters(), lr=1.0)
    sched = build_scheduler(opt, total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.0, time_fraction=lambda: spent[0])
    lrs = []
    for fraction in (0.0, 0.0, 0.5, 0.5, 0.99):
        spent[0] = fraction
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    kw = dict(total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.0)
    assert lrs[:2] == pytest.approx([lr_factor(1, **kw), lr_factor(2, **kw)])  # by steps while time is young
    assert lrs[2:] == pytest.approx([lr_factor(50, **kw), lr_factor(50, **kw), lr_factor(99, **kw)])  # by time


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 100.0])
def test_sync_scale_and_clip_equals_divide_then_clip_grad_norm(max_norm):
    """One multiply (1 / weight sum, times the clip coefficient) gives what dividing the gradients and then
    torch's clip_grad_norm_ gives; the returned norm is that of the divided gradients, before clipping. A
    parameter that got no gradient joins with zeros."""
    from dflash_trainer.train.optim import sync_scale_and_clip

    torch.manual_seed(1)
    ours, ref = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    extra = torch.nn.Parameter(torch.ones(3))  # never reached by a backward
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(9, 6)
    for model in (ours, ref):
        (model(x) ** 2).sum().backward()
    weight_sum = torch.tensor(7.0, dtype=torch.float64)
    norm = sync_scale_and_clip([*ours.parameters(), extra], weight_sum, max_norm=max_norm, group=None)
    for p in ref.parameters():
        p.grad /= 7.0
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.testing.assert_close(norm, ref_norm)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert torch.equal(extra.grad, torch.zeros(3))
    if max_norm == 0.5:  # the clip did act
        assert float(ref_norm) > 0.5
        assert float(torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])) == pytest.approx(0.5, rel=1e-4)
