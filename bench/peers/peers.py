"""Peer bake-off: a DFlash drafter trained by another trainer, NVIDIA Model Optimizer (ModelOpt) 0.47, on the
same target, data, GPU and wall time as ours, measured by our evaluator on the same held-out prompts.

    python bench/peers/peers.py modelopt --example .peer/modelopt/examples/speculative_decoding --minutes 5 \\
        [--cache DIR] [--target DIR] [--peer-python PY] [--calibrate-s 60]
    python bench/peers/peers.py table OURS.json PEER.json [--record]   # the side-by-side table (RESULTS.md)

The peer runs from its installed package (`nvidia-modelopt`) and its own example script, fetched into
`.peer/` (git-ignored; bench/README.md says how): this file and `peer_modelopt_run.py` only drive it.
- Data: the rows `bench/quality/quality.py` regenerated into its cache (`CACHE/train`), written as the OpenAI
  `messages` JSONL the example reads. Its answer-only loss needs `{% generation %}` tags in the chat
  template: `generation_template` writes the target's template with them and checks that it renders every
  row to the same text.
- Shape: ours (5 layers, B=16, the taps `choose_tap_layer_ids` gives, the target's mask token), with the
  head sizes and rope theta copied from the target (ModelOpt 0.47 copies neither). The rest is the example's
  own DFlash recipe (`general/speculative_decoding/dflash`: lr 6e-4, linear decay after 100 warmup steps,
  distillation from the target's logits, D-PACE weights, up to 512 anchors per sequence); sequences are
  padded to `--seq-len` (it pads every row), `--batch` rows per step.
- Time: a calibration run measures steps/s; the timed run's `max_steps` is set from it so that its schedule
  ends at the budget (the budget itself only guards). Counted from the first step, as `train.max_minutes`.
  `--max-steps N` instead trains exactly N steps (no calibration, no budget): equal steps or target tokens.
- Init: random (the example's own), or `--init target`: our step-0 drafter made from the target's layers
  (`drafter.init_from: target`), exported, and loaded into the peer's draft module before its first step
  (`peer_modelopt_run.py --init-weights`; ModelOpt 0.47 has no warm-start option of its own).
- Evaluation: its export (the example's `export_hf_checkpoint.py`, DFlash format) through `dflash-train eval`
  on the held-out prompts, prompt lookup beside it; `--peer-validate N`: and its own `validate_ar` on the first N
  (`peer_modelopt_validate.py`; its AR counts accepted draft tokens, tau adds the bonus token).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import ROOT, append_table_rows, git_commit, or_dash, write_result

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS_MD = ROOT / "bench" / "RESULTS.md"
TABLE_HEADER = ("| date | commit | trainer | recipe | budget min | steps | train s | real tokens/s | real tau | "
                "prompt lookup | tau / lookup | eval s |")
GENERATION_OPEN, GENERATION_CLOSE = "{% generation %}", "{% endgeneration %}"


def write_peer_data(regen_dir: Path, out: Path) -> int:
    """The regenerated rows as `{"messages": [...]}` lines (the row ids left out); returns the row count."""
    from dflash_trainer.regen import read_rows

    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w") as f:
        for row in read_rows(regen_dir):
            f.write(json.dumps({"messages": row["messages"]}, ensure_ascii=False) + "\n")
            n += 1
    return n


def generation_template(tokenizer, rows: list[list[dict]]) -> str:
    """The tokenizer's chat template with each assistant reply and its end-of-turn marker inside
    `{% generation %}` tags: what a ModelOpt answer-only loss needs. Only ChatML templates that render an
    assistant turn as `{{ m['content'] }}<|im_end|>` are rewritten; the result must render `rows` exactly as
    the original does (else SystemExit)."""
    original = tokenizer.chat_template
    body = "{{ m['content'] }}<|im_end|>"
    if not isinstance(original, str) or original.count(body + "\n") != 1 or GENERATION_OPEN in original:
        raise SystemExit("generation_template: not the ChatML template it knows; write a {% generation %} "
                         "template for this target by hand")
    # the newline after the turn is printed by an expression: templates trim the one after a block tag
    tagged = original.replace(
        body + "\n", "{% if m['role'] == 'assistant' %}" + GENERATION_OPEN + body + GENERATION_CLOSE
        + "{% else %}" + body + "{% endif %}{{ '\\n' }}")
    for messages in rows:
        before = tokenizer.apply_chat_template(messages, tokenize=False)
        after = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=tagged)
        if before != after:
            raise SystemExit(f"generation_template: renders differ for {messages[:1]}...; write one by hand")
    return tagged


def drafter_overrides(target_dir: Path, num_layers: int, block_size: int, mask_token_id: int) -> list[str]:
    """The example's `dflash.*` overrides for a drafter of our shape on this target."""
    from dflash_trainer.target.checks import choose_tap_layer_ids

    config = json.loads((target_dir / "config.json").read_text())
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    taps = choose_tap_layer_ids(config["num_hidden_layers"], num_layers)
    arch = {"num_hidden_layers": num_layers, "num_attention_heads": config["num_attention_heads"],
            "num_key_value_heads": config["num_key_value_heads"],
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "intermediate_size": config["intermediate_size"],
            "max_position_embeddings": config["max_position_embeddings"], "rope_theta": float(rope)}
    out = [f"dflash.dflash_block_size={block_size}", f"dflash.dflash_mask_token_id={mask_token_id}"]
    out += [f"dflash.dflash_architecture_config.{k}={v}" for k, v in arch.items()]
    out.append(f"dflash.dflash_architecture_config.target_layer_ids=[{','.join(map(str, taps))}]")
    return out


def recipe_overrides(args, work: Path, out_dir: Path, max_steps: int) -> list[str]:
    return [
        f"model.model_name_or_path={args.target}", f"data.data_path={work / 'train.jsonl'}",
        f"data.chat_template={work / 'chat_template.jinja'}", f"training.output_dir={out_dir}",
        f"training.max_steps={max_steps}", "training.num_train_epochs=1000",
        f"training.per_device_train_batch_size={args.batch}", f"training.training_seq_len={args.seq_len}",
        "training.save_steps=100000000", "training.report_to=none", "training.logging_steps=50",
        f"training.seed={args.seed}",
        *drafter_overrides(Path(args.target), args.num_layers, args.block_size, args.mask_token_id),
        *(["training.use_cpu=true", "training.bf16=false", "training.tf32=false"] if args.cpu else []),
        *args.peer_overrides,
    ]


def write_target_init(args, out: Path) -> Path:
    """Our step-0 drafter of this shape made from the target's layers (`drafter.init_from: target`, seed
    `--seed`), in the DFlash export layout, whose tensor names the peer's draft module shares; returns the
    weights file."""
    import torch
    from transformers import AutoConfig

    from dflash_trainer.config import load_config
    from dflash_trainer.drafter.export import export_drafter
    from dflash_trainer.drafter.spec import drafter_spec
    from dflash_trainer.train.trainer import build_drafter

    config = load_config("practice", [f"target.path={args.target}", f"drafter.num_layers={args.num_layers}",
                                      f"drafter.block_size={args.block_size}", "drafter.init_from=target",
                                      f"drafter.mask_token_id={args.mask_token_id}", f"run.seed={args.seed}",
                                      "drafter.gamma=7"])  # the loss's decay: no part of the weights, any block size
    target_config = AutoConfig.from_pretrained(args.target)
    model = build_drafter(config, drafter_spec(target_config, config.drafter), torch.device("cpu"))
    return export_drafter(model, out, target_config=target_config, dtype=torch.float32) / "model.safetensors"


# The example's DFlashConfig default: anchor positions sampled per row, each the start of one trained block.
EXAMPLE_ANCHORS = 512


def num_anchors(peer_overrides: list[str]) -> int:
    """The anchors per row a cell trains with: its `dflash.dflash_num_anchors=N` override, else the example's."""
    given = [o.split("=", 1)[1] for o in peer_overrides if o.startswith("dflash.dflash_num_anchors=")]
    return int(given[-1]) if given else EXAMPLE_ANCHORS


class PeerRunFailed(Exception):
    """The peer's training exited non-zero: its exit status, the end of its log, and whether it ran out of memory."""

    def __init__(self, name: str, rc: int, log: Path):
        self.rc, self.log_tail = rc, "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        self.out_of_memory = "OutOfMemoryError" in self.log_tail or "out of memory" in self.log_tail
        super().__init__(f"ModelOpt run {name} failed (rc {rc}); the end of {log}:\n{self.log_tail}")


def run_peer(args, work: Path, name: str, max_steps: int, budget_s: float, init: Path | None = None) -> dict:
    """One training run of the example in the peer's Python; returns its stats (peer_modelopt_run.py)."""
    out_dir, stats = work / name, work / f"{name}-stats.json"
    if out_dir.exists():
        raise SystemExit(f"{out_dir} exists: the example resumes from a checkpoint there; give a new --work")
    cmd = [args.peer_python, str(ROOT / "bench" / "peers" / "peer_modelopt_run.py"), "--example", str(args.example),
           "--budget-s", str(budget_s), "--stats", str(stats), *(["--init-weights", str(init)] if init else []), "--",
           "--config", "general/speculative_decoding/dflash", *recipe_overrides(args, work, out_dir, max_steps)]
    log = work / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=peer_env(args)).returncode
    if rc != 0 or not stats.is_file():
        raise PeerRunFailed(name, rc, log)
    result = json.loads(stats.read_text()) | {"wall_s": time.perf_counter() - t0, "out_dir": str(out_dir)}
    print(f"{name}: {result['steps']} steps in {result['seconds']:.1f} s "
          f"({result['real_tokens'] / max(result['seconds'], 1e-9):,.0f} real tokens/s)", flush=True)
    return result


def peer_env(args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def steps_for_budget(stats: dict, budget_s: float, skip: int = 10) -> int:
    """Steps the timed run can take in `budget_s`, from a calibration run's step times (its first `skip` steps,
    warm-up, left out of the rate)."""
    ends = stats["step_ends_s"]
    if len(ends) <= skip + 2:
        raise SystemExit(f"calibration ran only {len(ends)} steps: give it more time (--calibrate-s)")
    rate = (len(ends) - 1 - skip) / (ends[-1] - ends[skip])  # steps/s after warm-up
    return max(1, math.floor(rate * budget_s))


def steady_step_s(ends: list[float], skip: int = 5) -> float | None:
    """Seconds per step after the first `skip` (warm-up) steps, from the end times; None with too few steps."""
    if len(ends) <= skip + 1:
        return None
    return (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)


def step_time_summary(ends: list[float], skip: int = 2, slow: float = 3.0) -> dict:
    """The steps after the first `skip` (warm-up) from their end times: mean, median, and the mean without the
    steps over `slow` x the median (a recompile when a new padded shape arrives: a short measurement would
    overweight what a long run pays a few times), with their count. Empty with too few steps."""
    times = [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]
    if not times:
        return {}
    median = statistics.median(times)
    usual = [t for t in times if t <= slow * median]
    return {"step_s_mean": statistics.fmean(times), "step_s_median": median,
            "step_s_without_slow": statistics.fmean(usual), "slow_steps": len(times) - len(usual),
            "timed_steps": len(times)}


def export_and_eval(args, work: Path, trained: dict) -> dict:
    export = work / "export"
    cmd = [args.peer_python, "scripts/export_hf_checkpoint.py", "--model_path", trained["out_dir"],
           "--export_path", str(export)]
    done = subprocess.run(cmd, cwd=args.example, env=peer_env(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ModelOpt export failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    from dflash_trainer import cli

    cache = Path(args.cache)
    overrides = [f"target.path={args.target}", f"eval.prompts={cache / 'eval.jsonl'}",
                 f"eval.num_prompts={args.eval_prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
                 "logging.progress=false", *(["run.device=cpu"] if args.cpu else []), *args.eval_overrides]
    if cli.main(["eval", "--config", "practice", "--drafter", str(export), "--out", str(work / "eval"),
                 *overrides]) != 0:
        raise SystemExit("dflash-train eval of the ModelOpt export failed")
    return json.loads((work / "eval" / "eval.json").read_text())


def peer_validation(args, work: Path, trained: dict) -> dict | None:
    """The peer's own acceptance figure for its trained model (`peer_modelopt_validate.py`), or None."""
    if not args.peer_validate:
        return None
    out = work / "peer-validation.json"
    cmd = [args.peer_python, str(ROOT / "bench" / "peers" / "peer_modelopt_validate.py"), "--example", str(args.example),
           "--model", trained["out_dir"], "--prompts", str(Path(args.cache) / "eval.jsonl"), "--out", str(out),
           "--num-samples", str(args.peer_validate), "--steps", str(args.block_size - 1),
           "--osl", str(args.max_new_tokens)]
    done = subprocess.run(cmd, env=peer_env(args), capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        print(f"the peer's own validation failed (rc {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def modelopt(args) -> dict:
    work = Path(args.work or ROOT / "runs" / "peers" / f"modelopt-{datetime.now():%H%M%S}")
    work.mkdir(parents=True, exist_ok=True)
    rows = write_peer_data(Path(args.cache) / "train", work / "train.jsonl")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    sample = [json.loads(line)["messages"] for line in (work / "train.jsonl").read_text().splitlines()[:500]]
    (work / "chat_template.jinja").write_text(generation_template(tokenizer, sample))
    init = write_target_init(args, work / "init") if args.init == "target" else None
    if args.max_steps:
        max_steps, budget_s = args.max_steps, float("inf")
    else:
        budget_s = args.minutes * 60
        calibration = run_peer(args, work, "calibrate", 100000, args.calibrate_s, init)
        max_steps = steps_for_budget(calibration, budget_s)
        print(f"timed run: max_steps={max_steps} for {budget_s:.0f} s", flush=True)
    trained = run_peer(args, work, "timed", max_steps, budget_s * 1.05, init)
    report = {} if args.no_eval else export_and_eval(args, work, trained)
    validation = None if args.no_eval else peer_validation(args, work, trained)
    budget = f"{args.max_steps}steps" if args.max_steps else f"{args.minutes:g}min"
    return {
        "bench": "peers", "trainer": "modelopt", "name": args.name or f"modelopt-{args.init}-{budget}-s{args.seed}",
        "init": args.init, "seed": args.seed, "eval_overrides": args.eval_overrides,
        "date": datetime.now().strftime("%Y-%m-%d"), "commit": git_commit()[:7], "peer_version": peer_version(args),
        "budget_minutes": None if args.max_steps else args.minutes, "rows": rows, "batch": args.batch,
        "seq_len": args.seq_len, "block_size": args.block_size, "anchors": num_anchors(args.peer_overrides),
        "peer_overrides": args.peer_overrides,
        "steps": trained["steps"], "max_steps": max_steps, "train_s": trained["seconds"],
        "stopped_by_budget": trained["stopped_by_budget"], "real_tokens": trained["real_tokens"],
        "real_tokens_per_s": trained["real_tokens"] / trained["seconds"],
        "step_s_after_warmup": steady_step_s(trained["step_ends_s"]), **step_time_summary(trained["step_ends_s"]),
        "padded_tokens_per_s": trained["padded_tokens"] / trained["seconds"],
        # reply positions its loss can use, as ours' "supervised" count (None from a stats file without them)
        "loss_tokens": trained.get("loss_tokens"),
        "loss_tokens_per_s": trained["loss_tokens"] / trained["seconds"] if trained.get("loss_tokens") else None,
        "tau": report.get("tau"), "prompt_lookup_tau": report.get("prompt_lookup_tau"),
        "peer_validation": validation,
        "eval_seconds": report.get("seconds"), "acceptance_histogram": report.get("acceptance_histogram"),
        "overrides": recipe_overrides(args, work, Path(trained["out_dir"]), max_steps),
    }


def peer_version(args) -> str:
    done = subprocess.run([args.peer_python, "-c", "import modelopt, transformers; "
                           "print(modelopt.__version__, 'with transformers', transformers.__version__)"],
                          capture_output=True, text=True, env=peer_env(args))
    return done.stdout.strip() or "unknown"


def table_row(r: dict) -> str:
    ratio = r["tau"] / r["prompt_lookup_tau"] if r.get("tau") and r.get("prompt_lookup_tau") else None
    return (f"| {r['date']} | {r['commit']} | {r['trainer']} | {r['recipe']} | {or_dash(r['budget_minutes'], '{:g}')} | "
            f"{r['steps']} | {or_dash(r['train_s'], '{:.0f}')} | {or_dash(r['real_tokens_per_s'], '{:,.0f}')} | "
            f"{or_dash(r['tau'])} | {or_dash(r['prompt_lookup_tau'])} | {or_dash(ratio)}x | "
            f"{or_dash(r['eval_seconds'], '{:.1f}')} |")


def from_quality(result: dict) -> dict:
    """A `bench/quality/quality.py` result (our trainer) in the peer table's terms."""
    return {"date": result["date"], "commit": result["commit"], "trainer": "dflash-train",
            "recipe": " ".join([Path(result["recipe"]).stem, *result["overrides"]]),
            "budget_minutes": result.get("budget_minutes") or 0, "steps": result["steps"],
            "train_s": result.get("train_loop_s"), "real_tokens_per_s": result.get("overall_tokens_per_s"),
            "tau": result["tau"], "prompt_lookup_tau": result["prompt_lookup_tau"],
            "eval_seconds": result["eval_seconds"]}


def table(paths: list[Path], record: bool) -> None:
    rows = []
    for path in paths:
        r = json.loads(path.read_text())
        if r.get("bench") == "quality":
            r = from_quality(r)
        elif r.get("trainer") == "modelopt":
            r = r | {"recipe": f"ModelOpt {r['peer_version']} example recipe, {r.get('init', 'random')} init, seed "
                               f"{r.get('seed', 0)}, batch {r['batch']} x {r['seq_len']} padded"}
        rows.append(table_row(r))  # another peer's result names its recipe itself
    print(TABLE_HEADER)
    print("|" + "---|" * TABLE_HEADER.count(" | ") + "---|")
    print("\n".join(rows))
    if record:
        append_table_rows(RESULTS_MD, TABLE_HEADER, "Peer bake-off on the practice target (`bench/peers/peers.py`)", rows)


def parser() -> argparse.ArgumentParser:
    """The command line: `modelopt` (a cell: the lines of bench/peers/cells/ are its options) and `table`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("modelopt", help="train, export and evaluate a ModelOpt drafter")
    m.add_argument("--example", type=Path, default=ROOT / ".peer" / "modelopt" / "examples" / "speculative_decoding")
    m.add_argument("--target", default=None, help="the practice target's model dir (default: as bench/quality/quality.py)")
    m.add_argument("--cache", default=str(ROOT / ".cache" / "quality"), help="bench/quality/quality.py's data cache")
    m.add_argument("--work", default=None, help="a new folder for the peer's data, runs and export")
    m.add_argument("--minutes", type=float, default=5.0, help="training budget, from the first step")
    m.add_argument("--calibrate-s", type=float, default=60.0)
    m.add_argument("--max-steps", type=int, default=0, help="train exactly this many steps (no calibration, "
                   "no time budget): the equal-steps / equal-target-tokens protocol")
    m.add_argument("--init", choices=("random", "target"), default="random",
                   help="the peer's draft starts random (its own init) or from our target-initialised step 0")
    m.add_argument("--name", default=None, help="the result's name (default: modelopt-INIT-BUDGET-sSEED)")
    m.add_argument("--peer-overrides", nargs="*", default=[], metavar="k=v",
                   help="more of the example's own overrides, last (its sweep: training.learning_rate=3e-4 "
                   "dflash.dflash_num_anchors=80 training.dataloader_num_workers=4 ...)")
    m.add_argument("--no-eval", action="store_true", help="train only (its step times: a random-weight target of a "
                   "real shape, bench/peers/random_target.py), no export or evaluation")
    m.add_argument("--peer-validate", type=int, default=0, metavar="N",
                   help="also the peer's own acceptance measurement (its validate_ar) on the first N held-out prompts")
    m.add_argument("--eval-overrides", nargs="*", default=[], metavar="k=v",
                   help="extra `dflash-train eval` overrides, as the arms it is compared with (target.dtype=...)")
    m.add_argument("--peer-python", default=sys.executable)
    m.add_argument("--batch", type=int, default=16, help="rows per step (our recipe: 16,384 tokens per step)")
    m.add_argument("--seq-len", type=int, default=1280, help="padded row length (prompts <= 1,024 + 256 new tokens)")
    m.add_argument("--num-layers", type=int, default=5)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--mask-token-id", type=int, default=5)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--eval-prompts", type=int, default=40)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--cpu", action="store_true", help="smoke test on the CPU")
    m.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "peers")
    m.add_argument("--out", type=Path, help="also write the result JSON here")
    t = sub.add_parser("table", help="the side-by-side table of result JSONs (ours from bench/quality/quality.py)")
    t.add_argument("results", nargs="+", type=Path)
    t.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "table":
        table(args.results, args.record)
        return 0
    if args.target is None:
        from bench.quality.quality import default_target

        args.target = default_target()
    args.target, args.example = Path(args.target).resolve(), args.example.resolve()
    try:
        result = modelopt(args)
    except PeerRunFailed as e:  # a setting the peer cannot run (out of memory at 8B, say) is a result too
        print(e, flush=True)
        failed = {"bench": "peers", "trainer": "modelopt", "name": args.name or "modelopt", "status": "failed",
                  "out_of_memory": e.out_of_memory, "rc": e.rc, "log_tail": e.log_tail, "batch": args.batch,
                  "seq_len": args.seq_len, "block_size": args.block_size, "anchors": num_anchors(args.peer_overrides),
                  "peer_overrides": args.peer_overrides, "command": " ".join(sys.argv), "date": datetime.now().strftime("%Y-%m-%d")}
        write_result(failed, "peers", failed["name"], args.results, args.out)
        return 1
    write_result(result, "peers", result["name"], args.results, args.out)
    print(TABLE_HEADER)
    print(table_row(result | {"recipe": "ModelOpt example recipe"}))
    print(json.dumps({k: result[k] for k in ("name", "tau", "prompt_lookup_tau", "steps", "real_tokens_per_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
