"""Write a run's report: one PNG per figure and `index.html`, a self-contained page (images inlined) with a
header table of the run's essentials."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any, Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg

from dflash_trainer.eval.stats import plus_minus
from dflash_trainer.report.figures import draw_all
from dflash_trainer.report.runlog import RunLog, read_run
from dflash_trainer.rundir import RunDir

STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0}td{padding:3px 12px;border-bottom:1px solid #ddd;vertical-align:top}
td:first-child{color:#555}figure{margin:2em 0}img{max-width:100%;border:1px solid #eee}figcaption{color:#444}"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return "-" if value is None else str(value)


def essentials(run: RunLog) -> list[tuple[str, str]]:
    """The header table: the run's config essentials, its status and final figures."""
    cfg, s = run.config, run.summary
    target, drafter, data = cfg.get("target", {}), cfg.get("drafter", {}), cfg.get("data", {})
    pipeline, train = cfg.get("pipeline", {}), cfg.get("train", {})
    ev = s.get("eval") or {}
    val = ev.get("val") or {}
    status = s.get("status", "no summary (killed, or still running)")
    if s.get("status") == "failed":
        status += f" (rank {s.get('failed_rank')}: {s.get('cause')})"
    roles = s.get("roles")
    return [
        ("run", str(run.run_dir)),
        ("status", status),
        ("target", _fmt(target.get("path") or f"random {target.get('random_init')}") + f" ({target.get('dtype')})"),
        ("drafter", f"{drafter.get('num_layers')} layers, block {drafter.get('block_size')}, taps "
                    f"{_fmt(drafter.get('tap_layer_ids')) if drafter.get('tap_layer_ids') else 'default'}, init "
                    f"{drafter.get('init_from') or 'random'}"),
        ("data", f"{_fmt(data.get('path'))}, max length {data.get('max_length')}"),
        ("batches", f"{pipeline.get('token_budget')} tokens, lr {train.get('lr')}, {_fmt(train.get('max_steps'))} "
                    f"max steps, {_fmt(train.get('max_minutes'))} max minutes"),
        ("ranks", f"{s.get('world_size', '?')}: {', '.join(roles)}" if roles else "-"),
        ("steps", f"{_fmt(s.get('steps', run.steps[-1]['step'] if run.steps else None))} "
                  f"({_fmt(s.get('tokens_trained'))} tokens, {_fmt(s.get('elapsed_s'))} s)"),
        ("final loss / sim tau", f"{_fmt(s.get('final_loss'))} / {_fmt(s.get('final_sim_tau'))}"),
        ("real tau (prompt lookup)", f"{_fmt(ev.get('tau'))}{plus_minus(ev.get('tau_stderr'), digits=2)} "
                                     f"({_fmt(ev.get('prompt_lookup_tau'))}); best "
                                     f"{_fmt(ev.get('best_tau'))} at step {_fmt(ev.get('best_step'))}"),
        ("held-out walk tau / loss", f"{_fmt(val.get('walk_tau'))} / {_fmt(val.get('loss'))}"),
        ("tokens/s steady / overall", f"{_fmt(s.get('tokens_per_s'))} / {_fmt(s.get('overall_tokens_per_s'))} "
                                      f"(steady: after {_fmt(s.get('warmup_steps'))} warm-up steps)"),
        ("I / T tokens/s", f"{_fmt(s.get('I_tokens_per_s'))} / {_fmt(s.get('T_tokens_per_s'))} (target / drafter "
                           "capacity)"),
    ]


PAGE_START = "<!doctype html><html><head><meta charset='utf-8'><title>DFlash run "
"""How every report page we write begins: what tells a folder's index.html from someone else's."""


def foreign_report_files(folder: Path) -> list[str]:
    """The files of `folder` a report would write over (index.html, figures) when its index.html is not one of our
    reports: a web page or pictures of the user's."""
    index = folder / "index.html"
    try:
        ours = index.read_text(encoding="utf-8").startswith(PAGE_START)
    except (OSError, ValueError):
        ours = False
    if ours or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name == "index.html" or p.suffix == ".png")


def write_report(run_dir: str | Path, out_dir: Optional[str | Path] = None) -> Path:
    """Write the report of the run in `run_dir` to `out_dir` (default RUN_DIR/report); returns index.html."""
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else RunDir(run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for name, fig, caption in draw_all(run):
        buf = io.BytesIO()
        FigureCanvasAgg(fig).print_png(buf)
        (out / f"{name}.png").write_bytes(buf.getvalue())
        data = base64.b64encode(buf.getvalue()).decode()
        sections.append(f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in essentials(run))
    title = f"DFlash run {Path(run_dir).name}"
    page = (f"{PAGE_START}{html.escape(Path(run_dir).name)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1><table>{rows}</table>"
            + "".join(sections) + "</body></html>\n")
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
