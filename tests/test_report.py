"""`dflash-train report RUN_DIR`: seven figures and a self-contained page, written at the end of a run, from a
killed run's partial metrics, and from a resumed run's repeated steps."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from pipeline_helpers import train_in_process

from dflash_trainer.cli import main
from dflash_trainer.report.figures import FIGURES
from dflash_trainer.report.runlog import read_run


def _assert_report(out_dir, run_name: str) -> str:
    from matplotlib.image import imread

    page = (out_dir / "index.html").read_text()
    assert f"DFlash run {run_name}" in page
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', page)) == len(FIGURES) == 7
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch
    for name, _ in FIGURES:
        image = imread(out_dir / f"{name}.png")  # (h, w, 4) floats
        assert image.shape[0] > 300 and image.shape[1] > 600, name
        assert float(np.std(image[..., :3])) > 0.05, f"{name} looks blank"
    return page


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    assert train_in_process(run, "train.max_steps=12", "eval.interval=6", "train.checkpoint_interval=6") == 0
    return run


def test_train_writes_the_report_with_every_figure(trained):
    page = _assert_report(trained / "report", trained.name)
    assert "real tau (prompt lookup)" in page and "status</td><td>ok" in page
    run = read_run(trained)
    assert [r["step"] for r in run.steps] == list(range(1, 13))
    assert all("pool_depth" in r for r in run.steps[1:])  # the pipeline's figure has its data
    assert {r["role"] for r in run.summary["rank_time"]} == {"target", "drafter (leader)"}
    assert len(run.evals) == 2 and run.last_eval["prompt_lookup_histogram"]
    assert f"± {run.summary['eval']['tau_stderr']:.2f} (" in page  # real tau's standard error over the prompts


def test_report_of_a_killed_run_with_a_cut_metrics_file(trained, tmp_path, capsys):
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "config.yaml").write_text((trained / "config.yaml").read_text())
    text = (trained / "metrics.jsonl").read_text()
    (killed / "metrics.jsonl").write_text(text[: len(text) // 2 + 7])  # mid-line; no summary, no eval.json
    assert main(["report", str(killed), "--out", str(tmp_path / "out")]) == 0
    assert "report:" in capsys.readouterr().out
    page = _assert_report(tmp_path / "out", "killed")
    assert "no summary (killed, or still running)" in page
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "not a training run directory" in capsys.readouterr().err


def test_a_resumed_runs_repeated_steps_appear_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "sim_tau": 1.0} for s in range(1, 7)]  # killed after step 6
    rows.append({"step": 4, "eval_tau": 1.5})
    rows += [{"step": s, "loss": 4.0 - s / 10, "sim_tau": 2.0} for s in range(5, 9)]  # resumed from step 4
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = read_run(run)
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert log.steps[4]["sim_tau"] == 2.0 and log.steps[3]["sim_tau"] == 1.0  # the resumed run's rows win
    assert [r["step"] for r in log.evals] == [4]
    assert main(["report", str(run)]) == 0
    _assert_report(run / "report", "run")


def test_no_report_when_turned_off(tmp_path):
    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2", "eval.at_end=false", "logging.report=false") == 0
    assert (run / "summary.json").is_file() and not (run / "report").exists()


def test_the_throughput_figures_agree_in_log_summary_and_report(trained):
    """One definition each (train/throughput.py): the last metrics row's steady tokens/s is the summary's, the
    figure plots the rows' per-step rate, and the page labels steady and overall."""
    run = read_run(trained)
    s = run.summary
    assert s["warmup_steps"] == 3
    assert [r.get("tokens_per_s") is None for r in run.steps[:3]] == [True] * 3  # the warm-up has no steady figure
    assert run.steps[-1]["tokens_per_s"] == pytest.approx(s["tokens_per_s"])
    assert all(r["step_tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"]) for r in run.steps)
    assert s["T_tokens_per_s"] >= s["tokens_per_s"] * 0.99  # the drafter's capacity leaves its waits out
    page = (trained / "report" / "index.html").read_text()
    assert "tokens/s steady / overall" in page and "warm-up steps" in page


def test_throughput_leaves_the_warm_up_out_of_the_steady_figures():
    from dflash_trainer.train.throughput import ThroughputMeter

    meter = ThroughputMeter(0.0, warmup_steps=2)
    now = 0.0
    for step_time in (10.0, 10.0, 1.0, 1.0, 1.0, 1.0):  # two compiling steps, then 1 s each (0.5 s of it waiting)
        now += step_time
        rates = meter.step(100, step_time, 0.5 if step_time == 1.0 else 0.0, now)
    f = meter.figures()
    assert rates == {"step_tokens_per_s": 100.0, "tokens_per_s": 100.0}
    assert (f.tokens_per_s, f.drafter_tokens_per_s, f.warmup_steps) == (100.0, 200.0, 2)
    assert f.overall_tokens_per_s == pytest.approx(600 / 24)


def test_metrics_rows_of_wrong_types_are_left_out_not_a_traceback(tmp_path, capsys, caplog):
    """Rows that are not objects, or whose step is not an integer, are skipped (counted in a warning); values
    of the wrong type are left out of the figures; the page is still written."""
    import logging

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        [1, 2], "text", {"step": "3", "loss": 1.0}, {"step": True, "loss": 1.0},
        {"step": 1, "loss": 2.0, "tokens": 100, "step_time_s": 0.1, "wait_time_s": 0.01, "slot_acc": [0.1, 0.2],
         "lr": 1e-3, "grad_norm": 1.0, "pool_depth": 2, "jobs": [0], "skipped": False},
        {"step": 2, "loss": "high", "tokens": "many", "step_time_s": 0.1, "wait_time_s": "x", "slot_acc": ["a"],
         "lr": "fast", "grad_norm": {"a": 1}, "pool_depth": None, "jobs": "0", "skipped": "no", "sim_tau": "2"},
        {"step": 3, "loss": 1.5, "tokens": 100, "step_time_s": "slow", "slot_acc": [0.2, None]},
        {"step": 3, "eval_tau": "good", "val_slot_acc": "x", "val_walk_tau": [1], "eval_prompt_lookup_tau": {}},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    with caplog.at_level(logging.WARNING):
        assert main(["report", str(run)]) == 0
    assert (run / "report" / "index.html").is_file()
    assert any("4 rows of" in r.getMessage() and "metrics.jsonl" in r.getMessage() for r in caplog.records)
    log = read_run(run)
    assert [r["step"] for r in log.steps] == [1, 2, 3]
    assert log.steps[1] == {"step": 2, "loss": None, "step_time_s": 0.1}
    assert log.series("loss") == ([1, 3], [2.0, 1.5])


def test_the_tau_legend_covers_no_marker(tmp_path):
    """The tau figure's legend sits beside the axes: no evaluation marker (prompt lookup's, real tau's) can be under
    it, wherever the markers fall (inside, it covered the prompt-lookup marker of the demo's figure)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dflash_trainer.report import figures
    from dflash_trainer.report.runlog import RunLog

    steps = [{"step": s, "loss": 3.0, "sim_tau": 1.0 + s / 10} for s in range(1, 31)]
    evals = [{"step": s, "eval_tau": 1.5 + s / 30, "eval_prompt_lookup_tau": 1.8, "val_walk_tau": 1.4 + s / 30,
              "val_sim_tau": 1.6} for s in (1, 10, 20, 30)]
    run = RunLog(run_dir=tmp_path, config={}, summary={"eval": {"best_step": 30, "best_tau": 2.5}}, steps=steps,
                 evals=evals, last_eval=None)
    fig, _ = figures.tau(run)
    FigureCanvasAgg(fig).draw()
    (ax,) = fig.axes
    legend, plot = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= plot.x1, (legend, plot)  # beside the plot: it covers no point of it
    assert legend.x1 <= fig.bbox.x1 + 1  # and inside the figure (the constrained layout made room)
    points = [ax.transData.transform((r["step"], r[k])) for r in evals for k in ("eval_tau", "eval_prompt_lookup_tau")]
    assert all(plot.contains(*p) for p in points)


def test_the_marks_hide_nothing_and_a_resume_is_marked(tmp_path):
    """The best checkpoint is a ring the real-tau dot shows through; the lr figure's legend sits beside the axes, off
    the warm-up; a resumed session's start (the row resume writes) is a line in the loss, tau and lr figures."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dflash_trainer.report import figures
    from dflash_trainer.train.metrics import RESUMED

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "sim_tau": 1.0, "lr": min(1.0, s / 5) * 1e-3, "grad_norm": 1.0}
            for s in range(1, 7)]
    rows.append({"step": 4, "eval_tau": 1.5, "eval_prompt_lookup_tau": 1.2})
    rows.append({"step": 4, RESUMED: 1})  # resumed from step 4's checkpoint
    rows += [{"step": s, "loss": 4.0 - s / 10, "sim_tau": 2.0, "lr": 1e-3, "grad_norm": 1.0} for s in range(5, 9)]
    rows.append({"step": 8, "eval_tau": 2.5, "eval_prompt_lookup_tau": 1.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"eval": {"best_step": 8, "best_tau": 2.5}}))
    log = read_run(run)
    assert log.resumes == (4,)
    for draw in (figures.loss, figures.tau, figures.lr_and_grad_norm):
        fig, _ = draw(log)
        lines = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("resumed here")]
        assert len(lines) == 1 and list(lines[0].get_xdata()) == [4, 4], draw.__name__
    fig, _ = figures.tau(log)
    (ring,) = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("best checkpoint")]
    assert ring.get_markerfacecolor() == "none"  # hollow: the dot of the same evaluation shows inside it
    fig, _ = figures.lr_and_grad_norm(log)
    FigureCanvasAgg(fig).draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert box.x0 >= fig.axes[1].get_tightbbox().x1 - 1  # right of the twin's labels: it covers no curve
    assert box.x1 <= fig.bbox.x1 + 1  # and inside the figure
    assert [t.get_text() for t in legend.get_texts()][:2] == ["learning rate", "resumed here (its checkpoint's step)"]
