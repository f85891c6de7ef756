"""Metrics sinks: JSONL always on the leader, W&B through its API when enabled, null elsewhere."""

import json
import sys
import types

from dflash_trainer.train.metrics import build_sinks


def test_jsonl_and_wandb_sinks(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kw: calls.append(("init", kw["project"], kw["config"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = build_sinks(tmp_path, tensorboard=False, wandb=True, enabled=True, wandb_project="p", config={"lr": 1e-3})
    sink.log(3, {"loss": 1.5, "jobs": [1, 2], "eval_tau": float("nan")})
    sink.close()
    assert calls[0] == ("init", "p", {"lr": 1e-3})
    assert calls[1][:2] == ("log", 3) and calls[1][2]["loss"] == 1.5 and "jobs" not in calls[1][2]
    assert calls[-1] == ("finish",)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["step"] == 3 and row["jobs"] == [1, 2] and row["eval_tau"] is None


def test_non_leader_ranks_log_nothing(tmp_path):
    sink = build_sinks(tmp_path, tensorboard=True, wandb=True, enabled=False)
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()
