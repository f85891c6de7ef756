"""Roles, the store control plane and the buffered pool (single process, threads)."""

import threading
import time

import pytest
import torch.distributed as dist

from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.config import EvalConfig
from dflash_trainer.runtime.config import PipelineConfig
from dflash_trainer.runtime.control import Aborted, ControlPlane, StallTimeout
from dflash_trainer.runtime.failures import first_failure
from dflash_trainer.runtime.roles import Role, plan_placement
from dflash_trainer.runtime.setup import check_target_groups
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.transport.claims import Claim
from dflash_trainer.transport.pool import BufferedPool


def test_roles_first_local_ranks_are_targets():
    p = plan_placement(rank=5, world_size=8, local_rank=1, local_world_size=4, pipeline=PipelineConfig(num_targets=1))
    assert p.roles == (Role.TARGET, Role.DRAFTER, Role.DRAFTER, Role.DRAFTER) * 2
    assert p.role is Role.DRAFTER and p.target_ranks == (0, 4) and p.drafter_index == 3


def test_roles_target_groups_on_two_nodes():
    # 8 ranks per node: 2 target groups of 2 ranks (leader first), then 4 drafters; the same on node 2.
    p = plan_placement(rank=10, world_size=16, local_rank=2, local_world_size=8,
                       pipeline=PipelineConfig(num_targets=2, target_parallel=2))
    T, M, D = Role.TARGET, Role.TARGET_MEMBER, Role.DRAFTER
    assert p.roles == (T, M, T, M, D, D, D, D) * 2
    assert p.target_ranks == (0, 2, 8, 10)  # the producers: one per group
    assert p.target_groups == ((0, 1), (2, 3), (8, 9), (10, 11))
    assert p.role is T and p.target_group == (10, 11)
    member = plan_placement(rank=3, world_size=16, local_rank=3, local_world_size=8,
                            pipeline=PipelineConfig(num_targets=2, target_parallel=2))
    assert member.role is M and member.target_group == (2, 3) and not member.role.runs_target
    assert member.drafter_ranks == (4, 5, 6, 7, 12, 13, 14, 15)


def test_roles_single_process_and_colocated():
    p = plan_placement(rank=0, world_size=1, local_rank=0, local_world_size=1, pipeline=PipelineConfig())
    assert p.role is Role.COLOCATED
    p = plan_placement(rank=1, world_size=2, local_rank=1, local_world_size=2, pipeline=PipelineConfig(colocated=True))
    assert p.roles == (Role.COLOCATED, Role.COLOCATED)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=2, local_world_size=2, pipeline=PipelineConfig(num_targets=2)), "no drafter"),
        (dict(world_size=4, local_world_size=4, pipeline=PipelineConfig(), num_devices=2), "only 2 GPUs"),
        (dict(world_size=3, local_world_size=3, pipeline=PipelineConfig(num_targets=2, deterministic=True)), "exactly one target"),
        (dict(world_size=4, local_world_size=4, pipeline=PipelineConfig(num_targets=2, target_parallel=2)),
         r"num_targets=2 x pipeline.target_parallel=2 = 4 target ranks per node leave no drafter.*nproc_per_node > 4"),
        (dict(world_size=1, local_world_size=1, pipeline=PipelineConfig(target_parallel=2)),
         r"target_parallel=2 needs a split run under torchrun.*--nproc_per_node 3"),
    ],
)
def test_roles_misconfigurations_fail_clearly(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_placement(rank=0, local_rank=0, **kwargs)


def test_target_parallel_config_is_validated():
    with pytest.raises(ConfigError, match="pipeline.target_parallel must be >= 1"):
        PipelineConfig(target_parallel=0)
    with pytest.raises(ConfigError, match="pipeline.target_loads_per_node must be >= 1"):
        PipelineConfig(target_loads_per_node=0)
    with pytest.raises(ConfigError, match="target_parallel=2 needs a split run.*pipeline.colocated=false"):
        PipelineConfig(target_parallel=2, colocated=True)
    # Tau during the run needs the whole target on one rank: refused with the keys that turn it off.
    split = dict(pipeline=PipelineConfig(target_parallel=2), target=TargetConfig(random_init="tiny"))
    with pytest.raises(ConfigError, match="set eval.interval=0 and eval.at_end=false"):
        check_target_groups(Config(**split, eval=EvalConfig(at_end=True, prompts="prompts.jsonl")))
    check_target_groups(Config(**split, eval=EvalConfig(at_end=False, interval=0)))


def test_credits_never_overclaim_under_races():
    store = dist.HashStore()
    cp = ControlPlane(store, rank=0)
    cp.claims.grant_credits(7, 3)
    cp.claims.grant_credits(8, 1)
    got = []
    lock = threading.Lock()

    def worker():
        for _ in range(50):
            d = cp.claims.try_take_credit([7, 8])
            if d is not None:
                with lock:
                    got.append(d)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(got) == [7, 7, 7, 8]
    assert cp.claims.free_credits(7) == 0 and cp.claims.free_credits(8) == 0


def test_claims_arrive_in_order_and_cursor_hands_out_each_index_once():
    cp = ControlPlane(dist.HashStore(), rank=0)
    for j in range(3):
        cp.claims.post_claim(Claim(target_rank=0, drafter_rank=1, epoch=0, job_id=j))
    assert [cp.claims.wait_claim(1, i).job_id for i in (1, 2, 3)] == [0, 1, 2]
    assert [cp.next_job_index(0) for _ in range(3)] == [0, 1, 2]
    assert cp.next_job_index(1) == 0


def test_abort_flag_stops_waiters_and_first_cause_wins():
    store = dist.HashStore()
    waiter = ControlPlane(store, rank=1)
    ControlPlane(store, rank=2).abort("boom in target")
    ControlPlane(store, rank=3).abort("later failure")
    with pytest.raises(Aborted, match="rank 2 failed: boom in target"):
        waiter.claims.wait_claim(1, 1)


def test_stall_timeout_names_what_it_waited_for():
    cp = ControlPlane(dist.HashStore(), rank=0, stall_timeout_s=0.2)
    with pytest.raises(StallTimeout, match="claim 1 for drafter 4"):
        cp.claims.wait_claim(4, 1)


@pytest.mark.parametrize("at_once", [1, 2])
def test_turns_let_at_most_at_once_ranks_in_by_place_whatever_their_arrival(at_once):
    """Four ranks (threads, arriving last place first) take turns: never more than `at_once` inside, every
    one gets in, and with one at a time they go in the order of their places."""
    store = dist.HashStore()
    inside, most, served, lock = [0], [0], [], threading.Lock()

    def rank(place):
        with ControlPlane(store, rank=place, stall_timeout_s=10).turns("target_load/node0", at_once, place=place):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)  # a load: long enough for the others to arrive and wait
            with lock:
                inside[0] -= 1
                served.append(place)

    threads = [threading.Thread(target=rank, args=(place,)) for place in (3, 2, 1, 0)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=10)
    assert sorted(served) == [0, 1, 2, 3] and most[0] == at_once
    if at_once == 1:
        assert served == [0, 1, 2, 3]


def test_turns_wait_for_each_rank_ahead_and_count_a_failed_rank_as_left():
    store = dist.HashStore()

    def hold(place, seconds):
        with ControlPlane(store, rank=place, stall_timeout_s=0.3).turns("load", 1, place=place):
            time.sleep(seconds)

    # places 0 and 1 hold 0.2 s each: place 2 waits ~0.4 s, over one stall timeout but within one per turn ahead
    threads = [threading.Thread(target=hold, args=(place, 0.2)) for place in (0, 1)]
    for t in threads:
        t.start()
    hold(2, 0.0)
    for t in threads:
        t.join(timeout=5)
    # a rank that fails inside its turn still lets the next one in
    with pytest.raises(RuntimeError, match="load failed"):
        with ControlPlane(store, rank=3, stall_timeout_s=0.3).turns("load", 1, place=3):
            raise RuntimeError("load failed")
    hold(4, 0.0)
    # a held turn times out the rank behind it, naming what it waited for; an abort ends the wait at once
    other = ControlPlane(dist.HashStore(), rank=0, stall_timeout_s=0.2)
    with other.turns("x", 1, place=0):
        with pytest.raises(StallTimeout, match="its turn of x"):
            with ControlPlane(other.store, rank=1, stall_timeout_s=0.2).turns("x", 1, place=1):
                pass
        ControlPlane(other.store, rank=3).abort("load failed")
        with pytest.raises(Aborted, match="rank 3 failed: load failed"):
            with ControlPlane(other.store, rank=2, stall_timeout_s=5).turns("x", 1, place=3):
                pass


def test_pool_min_ready_random_choice_and_capacity():
    pool = BufferedPool(4, min_ready=2, seed=0, timeout_s=5)
    s0 = pool.acquire_free()
    pool.put_ready(s0, "a", 0)
    taken = []
    t = threading.Thread(target=lambda: taken.append(pool.take()))
    t.start()
    time.sleep(0.2)
    assert not taken  # one ready < min_ready
    s1 = pool.acquire_free()
    pool.put_ready(s1, "b", 1)
    t.join(2)
    assert taken and taken[0].item in ("a", "b")
    assert pool.occupied == 2
    for _ in range(2):
        pool.acquire_free()
    assert pool.occupied == 4
    with pytest.raises(TimeoutError):
        BufferedPool(1, min_ready=1, timeout_s=0.2).take()


def test_pool_drains_after_producers_done_and_forwards_errors():
    pool = BufferedPool(2, min_ready=2, fifo=True, timeout_s=5)
    for name in ("x", "y"):
        pool.put_ready(pool.acquire_free(), name, 0)
    pool.set_producers_done()
    assert [pool.take().item, pool.take().item] == ["x", "y"]
    assert pool.take() is None
    bad = BufferedPool(2, min_ready=1, timeout_s=5)
    bad.set_error(ValueError("recv broke"))
    with pytest.raises(RuntimeError, match="recv broke"):
        bad.take()


def test_pool_does_not_deadlock_when_consumer_holds_slots():
    pool = BufferedPool(2, min_ready=2, timeout_s=2)
    pool.put_ready(pool.acquire_free(), 1, 0)
    pool.put_ready(pool.acquire_free(), 2, 0)
    first = pool.take()  # held by the consumer: its slot cannot refill, one more ready batch must suffice
    assert pool.take() is not None
    pool.release(first.slot)


def test_the_printed_summary_reads_as_text_not_python_reprs(capsys):
    from dflash_trainer.runtime.summary import print_summary

    summary = {"status": "ok", "steps": 264, "jobs_planned": {"0": 44, "1": 44}, "final_loss": 5.84123,
               "eval": {"step": 264, "tau": 3.1074, "tau_stderr": 0.6972, "prompt_lookup_tau": 1.8077,
                        "best_tau": 3.1074, "best_step": 264, "best_dir": "R/best",
                        "val": {"walk_tau": 3.418, "slot_accuracy": (0.78, 0.76)}}}
    print_summary(summary, "R")
    out = capsys.readouterr().out
    assert "real tau 3.107 ± 0.6972 at step 264; prompt lookup 1.808; best 3.107 at step 264 (R/best); held-out " \
           "walk tau 3.418" in out
    assert "0: 44, 1: 44" in out and "5.841" in out
    assert "{" not in out and "(0.78" not in out


def test_first_failure_waits_for_the_cause_a_broken_connection_comes_before():
    """A rank whose connection broke names the job's first failure, not 'unknown': a peer process found dead only
    after a while (the kernel closes a killed process's sockets before the process is gone), or a cause recorded just
    after the break; nothing at all within the bound is None, after the bound."""
    calls = []
    found = ControlPlane(dist.HashStore(), rank=0)
    info = first_failure(found, lambda: calls.append(1) or ([1] if len(calls) >= 5 else []), within_s=5, poll_s=0.01)
    assert info is not None and info.rank == 1 and "died without a word" in info.cause and len(calls) == 5

    recorded = ControlPlane(dist.HashStore(), rank=0)
    timer = threading.Timer(0.2, lambda: ControlPlane(recorded.store, rank=2).abort("InjectedFault: boom"))
    timer.start()
    info = first_failure(recorded, lambda: [], within_s=5, poll_s=0.01)
    assert info is not None and (info.rank, info.cause) == (2, "InjectedFault: boom")

    start = time.monotonic()
    assert first_failure(ControlPlane(dist.HashStore(), rank=0), lambda: [], within_s=0.3, poll_s=0.05) is None
    assert time.monotonic() - start >= 0.3


def test_the_rendezvous_a_rank_watches_comes_from_its_torchrun_agent_command_line():
    """A c10d rendezvous's endpoint and id, as `python -m torch.distributed.run` or `torchrun` was given them (the
    default port when none); nothing for the static rendezvous of `--master_addr`, or a command that is no torchrun."""
    from dflash_trainer.runtime.rendezvous import agent_rendezvous

    module = ["/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a17:29555", "--rdzv-id", "dflash-731",
              "-m", "dflash_trainer", "train", "--config", "demo"]
    assert agent_rendezvous(module) == ("gpu-a17", 29555, "dflash-731")
    script = ["/venv/bin/torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0", "train.py"]
    assert agent_rendezvous(script) == ("node0", 29400, "none")
    static = ["/venv/bin/python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
              "127.0.0.1", "--master_port", "29500", "-m", "dflash_trainer", "train"]
    assert agent_rendezvous(static) is None
    assert agent_rendezvous(["/usr/bin/python", "-m", "dflash_trainer", "train"]) is None


def test_the_rendezvous_record_is_read_with_its_own_classes_only():
    """torch's record (as its agents write it: base64 of a pickle) reads back whole; bytes naming any other callable
    (here os.system) are refused before anything is built."""
    import base64
    import os
    import pickle
    from datetime import datetime

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from dflash_trainer.runtime.rendezvous import read_rendezvous_state

    state = _RendezvousState()
    state.closed = True
    node = _NodeDesc("node0", 4242, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime(2026, 12, 6)
    read = read_rendezvous_state(base64.b64encode(pickle.dumps(state)))
    assert read.closed and read.participants == {node: 0} and read.last_heartbeats[node] == datetime(2026, 12, 6)

    class Hostile:
        def __reduce__(self):
            return os.system, ("echo never",)

    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        read_rendezvous_state(base64.b64encode(pickle.dumps(Hostile())))
