"""The report's figures, drawn with matplotlib (Agg, no display) from a `RunLog`.

Each function returns (figure, caption). A figure whose data the run does not have (no evaluation, a killed
run without a summary) says so inside the plot instead of being left out, so the page always has all seven.
"""

from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure

from dflash_trainer.report.runlog import RunLog

COLORS = {"train": "#4c72b0", "held": "#dd8452", "real": "#c44e52", "lookup": "#8c8c8c", "walk": "#55a868"}


def _figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(7.5 * ncols if ncols > 1 else 8.0, 4.2), dpi=110, layout="constrained")
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, axes


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what they have)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, n // 40)


def _mark_resumes(ax, run: RunLog) -> None:
    """A dotted line where each resumed session started (its checkpoint's step)."""
    for i, step in enumerate(run.resumes):
        ax.axvline(step, color="#555555", ls=":", lw=1.2, zorder=0,
                   label="resumed here (its checkpoint's step)" if i == 0 else None)


def _legend_outside(ax, *axes) -> None:
    """One legend beside the axes for `ax` and any twin `axes`: it covers no curve (the warm-up at the left, the
    last evaluation at the right edge)."""
    handles, labels = [], []
    for a in (ax, *axes):
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    if axes:  # a twin's tick labels stand right of the axes: the figure's legend goes right of everything
        ax.figure.legend(handles, labels, fontsize=8, loc="outside right upper")
    else:
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="#666666")


def loss(run: RunLog) -> tuple[Figure, str]:
    fig, (ax,) = _figure()
    xs, ys = run.series("loss")
    if xs:
        ax.plot(xs, ys, color=COLORS["train"], alpha=0.25, lw=0.8)
        ax.plot(xs, _smooth(ys, _window(len(ys))), color=COLORS["train"], lw=1.8, label="training batches (smoothed)")
    vx, vy = run.series("val_loss", run.evals)
    if vx:
        ax.plot(vx, vy, "o-", color=COLORS["held"], label="held-out conversations")
    _mark_resumes(ax, run)
    if not xs and not vx:
        _empty(ax, "no step logged yet")
    ax.set(xlabel="optimizer step", ylabel="loss (weighted cross-entropy, nats)", title="Loss")
    if xs or vx:
        ax.legend()
    return fig, "Training loss per step (faint) and smoothed, and the same loss on held-out conversations."


def tau(run: RunLog) -> tuple[Figure, str]:
    fig, (ax,) = _figure()
    xs, ys = run.series("sim_tau")
    if xs:
        ax.plot(xs, _smooth(ys, _window(len(ys))), color=COLORS["train"], lw=1.5, label="simulated, training batches")
    for key, color, marker, label in (("val_sim_tau", COLORS["held"], "s", "simulated, held-out (every anchor)"),
                                      ("val_walk_tau", COLORS["walk"], "^", "walk, held-out (as decoding walks)"),
                                      ("eval_tau", COLORS["real"], "o", "real, speculative decoding"),
                                      ("eval_prompt_lookup_tau", COLORS["lookup"], "x", "prompt lookup (no training)")):
        ex, ey = run.series(key, run.evals)
        if ex:
            ax.plot(ex, ey, marker=marker, color=color, lw=1.2, ls="--" if "lookup" in key else "-", label=label,
                    zorder=3)
    best = (run.summary.get("eval") or {})
    if best.get("best_step") is not None:  # a ring around the real-tau dot, which stays visible inside it
        ax.plot([best["best_step"]], [best["best_tau"]], marker="o", ms=16, mfc="none", mec="goldenrod", mew=2.5,
                ls="none", zorder=4, label=f"best checkpoint (step {best['best_step']}, tau {best['best_tau']:.2f})")
    _mark_resumes(ax, run)
    if not xs and not run.evals:
        _empty(ax, "no step logged yet")
    else:
        _legend_outside(ax)
    ax.set(xlabel="optimizer step", ylabel="acceptance length tau (tokens per step)", title="Acceptance length")
    return fig, ("Simulated tau on training batches overstates real decoding; walk tau on held-out replies tracks it. "
                 "Real tau is beside prompt lookup on the same prompts; the gold ring is the checkpoint kept in best/.")


def slot_accuracy(run: RunLog) -> tuple[Figure, str]:
    fig, (ax, ax2) = _figure(2)
    rows = [r for r in run.steps if r.get("slot_acc")]
    if rows:
        stride = max(1, len(rows) // 40)
        picked = rows[::stride]
        grid = [r["slot_acc"] for r in picked]
        image = ax.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis",
                          extent=(0.5, len(grid[0]) + 0.5, picked[0]["step"], max(picked[-1]["step"], picked[0]["step"] + 1)))
        fig.colorbar(image, ax=ax, label="accuracy")
        ax.set(xlabel="block slot k (predicts anchor + k)", ylabel="optimizer step", title="Accuracy by slot, training")
        slots = range(1, len(rows[-1]["slot_acc"]) + 1)
        ax2.plot(slots, rows[-1]["slot_acc"], "o-", color=COLORS["train"], label=f"training, step {rows[-1]['step']}")
        held = [r for r in run.evals if r.get("val_slot_acc")]
        if held:
            ax2.plot(slots, held[-1]["val_slot_acc"], "s-", color=COLORS["held"],
                     label=f"held-out, step {held[-1]['step']}")
        ax2.set(xlabel="block slot k", ylabel="accuracy", ylim=(0, 1), title="Last step, training vs held-out")
        ax2.legend()
    else:
        _empty(ax, "no step logged yet")
        _empty(ax2, "no step logged yet")
    return fig, "Argmax accuracy of each block slot over training (left), and at the end against held-out data (right)."


def acceptance(run: RunLog) -> tuple[Figure, str]:
    fig, (ax,) = _figure()
    ev = run.last_eval or {}
    hist = ev.get("acceptance_histogram")
    if hist:
        width = 0.4
        lengths = list(range(1, len(hist) + 1))
        total = max(1, sum(hist))
        ax.bar([k - width / 2 for k in lengths], [c / total for c in hist], width, color=COLORS["real"],
               label=f"drafter (tau {ev.get('tau', 0):.2f})")
        lookup = ev.get("prompt_lookup_histogram")
        if lookup:
            ax.bar([k + width / 2 for k in lengths], [c / max(1, sum(lookup)) for c in lookup], width,
                   color=COLORS["lookup"], label=f"prompt lookup (tau {ev.get('prompt_lookup_tau', 0):.2f})")
        ax.set_xticks(lengths)
        ax.legend()
        title = f"Acceptance lengths, step {ev.get('step', '?')}, {ev.get('prompts', '?')} prompts"
    else:
        _empty(ax, "no real-tau evaluation in this run (eval.at_end=false, or it ended early)")
        title = "Acceptance lengths"
    ax.set(xlabel="tokens committed per verification step", ylabel="fraction of steps", title=title)
    return fig, "How many tokens each verification step committed in the last evaluation, against prompt lookup."


def throughput(run: RunLog) -> tuple[Figure, str]:
    fig, (ax,) = _figure()
    xs, per_step = run.series("step_tokens_per_s")
    if xs:
        ax.plot(xs, per_step, color=COLORS["train"], alpha=0.3, lw=0.8)
        ax.plot(xs, _smooth(per_step, _window(len(per_step))), color=COLORS["train"], lw=1.8,
                label="one step's tokens / its time (smoothed)")
        warmup = run.summary.get("warmup_steps")
        for key, color, style, label in (
                ("tokens_per_s", COLORS["real"], "-", f"steady (after {warmup} warm-up steps)"),
                ("overall_tokens_per_s", COLORS["lookup"], ":", "overall (warm-up included)"),
                ("I_tokens_per_s", COLORS["held"], "--", "I: target capacity"),
                ("T_tokens_per_s", COLORS["walk"], "--", "T: drafter capacity")):
            if run.summary.get(key):
                ax.axhline(run.summary[key], color=color, ls=style, label=f"{label} ({run.summary[key]:,.0f})")
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no step logged yet")
    ax.set(xlabel="optimizer step", ylabel="tokens / s", title="Throughput")
    return fig, ("Tokens trained per second. Each step: its tokens over its time, waits included. Steady: every "
                 "token after the warm-up steps (compilation) over the time since, checkpoints and evaluations "
                 "included. Overall: the same with the warm-up. T: the drafter's capacity (its waits left out); I: the "
                 "target's (tokens over its forward time).")


def pipeline(run: RunLog) -> tuple[Figure, str]:
    fig, (ax, ax2) = _figure(2)
    rows = [r for r in run.steps if r.get("step_time_s")]
    if rows:
        xs = [r["step"] for r in rows]
        wait = [min(1.0, r.get("wait_time_s", 0.0) / r["step_time_s"]) for r in rows]
        ax.plot(xs, _smooth(wait, _window(len(wait))), color=COLORS["real"], label="drafter wait fraction")
        ax.set(xlabel="optimizer step", ylabel="fraction of the step spent waiting for batches", ylim=(0, 1),
               title="Drafter waits and pool depth")
        dx, dy = run.series("pool_depth")
        if dx:
            twin = ax.twinx()
            twin.plot(dx, _smooth(dy, _window(len(dy))), color=COLORS["train"], label="pool depth (ready batches)")
            twin.set_ylabel("ready batches at a take")
            twin.set_ylim(0, max(dy) * 1.15 + 0.5)
            twin.legend(loc="lower right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    else:
        _empty(ax, "no step logged yet")
    ranks = run.summary.get("rank_time") or []
    if ranks:
        labels = [f"rank {r['rank']}\n{r['role']}" for r in ranks]
        busy = [r["busy_s"] for r in ranks]
        idle = [max(0.0, r["wall_s"] - r["busy_s"]) for r in ranks]
        ax2.barh(labels, busy, color=COLORS["walk"], label="busy")
        ax2.barh(labels, idle, left=busy, color="#cccccc", label="idle / waiting")
        ax2.set(xlabel="seconds", title="Busy and idle time per rank")
        ax2.legend(fontsize=8)
    else:
        _empty(ax2, "no per-rank times: the run did not finish" if not run.summary else "no per-rank times in the summary")
    return fig, "Where the pipeline waits: the drafter's wait fraction and pool depth per step, and each rank's busy time."


def lr_and_grad_norm(run: RunLog) -> tuple[Figure, str]:
    fig, (ax,) = _figure()
    xs, ys = run.series("lr")
    if xs:
        ax.plot(xs, ys, color=COLORS["train"], label="learning rate")
        ax.set_ylabel("learning rate")
        twin = ax.twinx()
        gx, gy = run.series("grad_norm")
        twin.plot(gx, gy, color=COLORS["held"], alpha=0.6, lw=0.8, label="grad norm (before clipping)")
        skipped = [r["step"] for r in run.steps if r.get("skipped")]
        if skipped:
            top = max(gy) if gy else 1.0
            twin.plot(skipped, [top] * len(skipped), "x", color="red", ms=9, label=f"skipped step ({len(skipped)})")
        twin.set_ylabel("gradient norm")
        _mark_resumes(ax, run)
        _legend_outside(ax, twin)
    else:
        _empty(ax, "no step logged yet")
    ax.set(xlabel="optimizer step", title="Learning rate and gradient norm")
    return fig, "The schedule's learning rate and the gradient norm; red crosses mark steps skipped for NaN/inf."


FIGURES = (("loss", loss), ("tau", tau), ("slot_accuracy", slot_accuracy), ("acceptance", acceptance),
           ("throughput", throughput), ("pipeline", pipeline), ("lr_grad_norm", lr_and_grad_norm))
"""(file stem, function) in page order."""


def draw_all(run: RunLog) -> list[tuple[str, Figure, str]]:
    return [(name, *fn(run)) for name, fn in FIGURES]
