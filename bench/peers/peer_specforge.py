"""Peer bake-off, the second peer: a DFlash drafter trained by SpecForge's own DFlash script on the same target,
data and GPU as ours, for exactly N steps, measured by our evaluator on the same held-out prompts.

    python bench/peers/peer_specforge.py --max-steps N [--source .peer/specforge] [--cache DIR] [--target DIR] \\
        [--work DIR] [--peer-python PY] [--batch 16] [--no-eval] [-- SCRIPT ARGUMENTS, last: they win]

The peer is sgl-project/SpecForge at 40d8fef (the last commit with `scripts/train_dflash.py` and its in-process
Hugging Face target; later ones train only against an SGLang server), run from its source, fetched into
`.peer/specforge` (git-ignored; bench/README.md says how), as its DFlash example runs it on one GPU:
`torchrun --standalone --nproc_per_node 1 scripts/train_dflash.py --target-model-backend hf ...` (NCCL, FSDP,
flex attention: CUDA only). This file and `peer_specforge_run.py` only drive it.
- Imports: its argument parser imports one list from sglang (the choices of its sglang backend's attention flag),
  which the device does not have and the HF backend never runs: a module holding that list alone is written into
  the run's folder, first on the peer's path. Its other needs (datasets, pydantic, yunchang) come from `.whl`.
- Data: the rows `bench/quality/quality.py` regenerated into its cache (`CACHE/train`), written as the `conversations`
  JSONL it reads. It renders them with the target's chat template; its `qwen` entry (`--chat-template`) marks the
  assistant replies for the loss and gives rows without a system turn its default system prompt.
- Shape: ours (5 layers, B=16, the taps `choose_tap_layer_ids` gives, the mask token of `--mask-token-id`: the
  practice target's reserved one, as bench/peers/peers.py), with the rest of the draft config (head sizes, rope) the
  target's own, written as the draft config it reads (`layer_types` cut to the drafter's layers).
- Recipe: its DFlash recipe (lr 6e-4, cosine after 4% warm-up, gradient clipping at 1.0, up to 512 anchors a
  row, loss decay gamma 7, flex attention, bf16 weights with fp32 AdamW masters), `--batch` rows a step padded to
  the longest, rows cut at `--max-length`.
- Steps: the script has no step cap (it trains whole epochs); `peer_specforge_run.py` hands it a loader of exactly
  N batches (passes over the data, each with its next epoch's shuffle), so its schedule ends at step N and it
  saves its checkpoint there; it also times every step and counts the real tokens. Counted from the first step.
- Init: random (its own), or `--init target`: our step-0 drafter made from the target's layers (as bench/peers/peers.py's
  `--init target`), written as its checkpoint `epoch_0_step_0` (the same DFlash layout) and taken up by its own
  `--resume`, which loads a checkpoint's weights and, with no optimizer state there, starts at step 0.
- Evaluation: that checkpoint (config.json + model.safetensors, the z-lab DFlash layout our loader reads) through
  `dflash-train eval` on the held-out prompts, prompt lookup beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import ROOT, git_commit, write_result
from bench.peers.peers import TABLE_HEADER, steady_step_s, step_time_summary, table_row, write_target_init

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPE = ["--learning-rate", "6e-4", "--warmup-ratio", "0.04", "--max-grad-norm", "1.0", "--num-anchors", "512",
          "--loss-type", "dflash", "--loss-decay-gamma", "7.0", "--attention-backend", "flex_attention",
          "--chat-template", "qwen"]
"""Its DFlash recipe (examples/run_qwen3_8b_dflash_online.sh), as script arguments."""
SGLANG_STUB = '''"""Written by dflash-train's bench/peers/peer_specforge.py, not sglang: SpecForge's argument parser imports
this list for its sglang backend's attention flag; the in-process Hugging Face target backend never runs sglang."""
ATTENTION_BACKEND_CHOICES = ["flashinfer"]
'''


def write_conversations(regen_dir: Path, out: Path) -> int:
    """The regenerated rows as `{"conversations": [{role, content}, ...]}` lines; returns the row count."""
    from dflash_trainer.regen import read_rows

    lines = [json.dumps({"conversations": row["messages"]}, ensure_ascii=False) for row in read_rows(regen_dir)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return len(lines)


def draft_config(target_dir: Path, num_layers: int, block_size: int, mask_token_id: int) -> dict:
    """The draft config the script reads (`--draft-config-path`): the target's config (head sizes, rope, norms)
    with our drafter's depth, block size, taps and mask token."""
    from dflash_trainer.target.checks import choose_tap_layer_ids

    config = json.loads((target_dir / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        print(f"note: the target is {config.get('model_type')}; the peer's drafter is Qwen3 layers of its sizes")
    vocab = config["vocab_size"]
    if not 0 <= mask_token_id < vocab:
        raise SystemExit(f"--mask-token-id {mask_token_id} is not below the target's vocabulary ({vocab})")
    target_layers = config["num_hidden_layers"]
    for key in ("transformers_version", "auto_map", "quantization_config"):
        config.pop(key, None)
    return config | {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "num_hidden_layers": num_layers, "layer_types": ["full_attention"] * num_layers,
        "max_window_layers": num_layers, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": False, "block_size": block_size, "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": choose_tap_layer_ids(target_layers, num_layers)},
    }


def script_args(args, work: Path, out_dir: Path) -> list[str]:
    """The script's arguments: the run's paths and shape, its recipe, then `-- ...` (last, so they win)."""
    return [
        "--target-model-path", str(args.target), "--target-model-backend", "hf",
        "--draft-config-path", str(work / "draft_config.json"), "--block-size", str(args.block_size),
        "--mask-token-id", str(args.mask_token_id), "--train-data-path", str(work / "train.jsonl"),
        "--output-dir", str(out_dir), "--cache-dir", str(work / "cache"), "--num-epochs", "1",
        "--batch-size", str(args.batch), "--max-length", str(args.max_length), "--seed", str(args.seed),
        "--log-interval", "50", "--save-interval", str(10**9), "--report-to", "none", *RECIPE,
        *(["--resume"] if args.init == "target" else []), *args.peer_args,
    ]


def peer_env(args, work: Path) -> dict:
    """The peer's environment: offline, the sglang stand-in and its source first on the path."""
    stub = work / "sglang-stub" / "sglang" / "srt"
    stub.mkdir(parents=True, exist_ok=True)
    for init in (stub.parent / "__init__.py", stub / "__init__.py"):
        init.write_text("")
    (stub / "server_args.py").write_text(SGLANG_STUB)
    path = [str(stub.parent.parent), str(args.source), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf-datasets"), TOKENIZERS_PARALLELISM="false")


def run_peer(args, work: Path) -> dict:
    """The training run under torchrun, in the peer's Python (peer_specforge_run.py); returns its stats."""
    out_dir, stats = work / "out", work / "stats.json"
    if out_dir.exists():
        raise SystemExit(f"{out_dir} exists: give a new --work")
    if args.init == "target":  # its --resume finds this as its last checkpoint: weights only, step 0
        write_target_init(args, out_dir / "epoch_0_step_0")
    cmd = [args.peer_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(ROOT / "bench" / "peers" / "peer_specforge_run.py"), "--script", str(args.source / "scripts" / "train_dflash.py"),
           "--max-steps", str(args.max_steps), "--stats", str(stats), "--", *script_args(args, work, out_dir)]
    log = work / "train.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=peer_env(args, work), cwd=work).returncode
    if rc != 0 or not stats.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"SpecForge run failed (rc {rc}); the end of {log}:\n{tail}")
    result = json.loads(stats.read_text()) | {"wall_s": time.perf_counter() - t0,
                                              "checkpoint": str(checkpoint_dir(out_dir, args.max_steps))}
    print(f"specforge: {result['steps']} steps in {result['seconds']:.1f} s "
          f"({result['real_tokens'] / max(result['seconds'], 1e-9):,.0f} real tokens/s)", flush=True)
    return result


def checkpoint_dir(out_dir: Path, steps: int) -> Path:
    """The script's final save, `epoch_{E}_step_{steps}`."""
    found = sorted(out_dir.glob(f"epoch_*_step_{steps}"))
    if not found or not (found[-1] / "model.safetensors").is_file():
        raise SystemExit(f"no checkpoint epoch_*_step_{steps} with model.safetensors under {out_dir}")
    return found[-1]


def evaluate(args, work: Path, checkpoint: str) -> dict:
    """`dflash-train eval` of the saved checkpoint on the held-out prompts (ours and prompt lookup)."""
    from dflash_trainer import cli

    out = work / "eval"
    code = cli.main(["eval", "--config", "practice", "--drafter", checkpoint, "--out", str(out),
                     f"target.path={args.target}", f"eval.prompts={args.cache / 'eval.jsonl'}",
                     f"eval.num_prompts={args.eval_prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
                     "logging.progress=false", *args.eval_overrides])
    if code != 0:
        raise SystemExit("dflash-train eval of the SpecForge checkpoint failed")
    return json.loads((out / "eval.json").read_text())


def peer_version(args, work: Path) -> str:
    """`SpecForge VERSION (COMMIT) with torch X transformers Y`: its version.txt, the COMMIT file written when it
    was fetched (bench/README.md), the peer Python's packages."""
    version, commit = (args.source / "version.txt", args.source / "COMMIT")
    version = version.read_text().strip() if version.is_file() else "?"
    commit = commit.read_text().strip()[:7] if commit.is_file() else "unknown commit"
    done = subprocess.run([args.peer_python, "-c", "import torch, transformers; "
                           "print('with torch', torch.__version__, 'transformers', transformers.__version__)"],
                          capture_output=True, text=True, env=peer_env(args, work))
    return f"SpecForge {version} ({commit}) {done.stdout.strip()}".strip()


def specforge(args) -> dict:
    work = Path(args.work or ROOT / "runs" / "peers" / f"specforge-{datetime.now():%H%M%S}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = write_conversations(args.cache / "train", work / "train.jsonl")
    config = draft_config(args.target, args.num_layers, args.block_size, args.mask_token_id)
    (work / "draft_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{rows} rows; drafter taps {config['dflash_config']['target_layer_ids']} of "
          f"{config['num_target_layers']} layers", flush=True)
    trained = run_peer(args, work)
    if args.no_eval:  # its save holds fp32 masters and AdamW moments too (large at 8B), not needed here
        shutil.rmtree(work / "out")
        trained["checkpoint"] = None
    report = {} if args.no_eval else evaluate(args, work, trained["checkpoint"])
    version = peer_version(args, work)
    return {
        "bench": "peers", "trainer": "specforge",
        "name": args.name or f"specforge-{args.init}-{args.max_steps}steps-s{args.seed}",
        "seed": args.seed, "date": datetime.now().strftime("%Y-%m-%d"), "commit": git_commit()[:7],
        "peer_version": version, "init": args.init,
        "recipe": f"{version.split(' with ')[0]} DFlash recipe, {args.init} init, seed "
        f"{args.seed}, batch {args.batch} (padded to the longest)", "budget_minutes": None, "rows": rows,
        "batch": args.batch, "max_length": args.max_length, "steps": trained["steps"], "max_steps": args.max_steps,
        "train_s": trained["seconds"], "wall_s": trained["wall_s"], "stopped_by_budget": False,
        "data_passes": trained["data_passes"], "real_tokens": trained["real_tokens"],
        "loss_tokens": trained["loss_tokens"], "real_tokens_per_s": trained["real_tokens"] / trained["seconds"],
        "padded_tokens_per_s": trained["padded_tokens"] / trained["seconds"],
        "step_s_after_warmup": steady_step_s(trained["step_ends_s"]), **step_time_summary(trained["step_ends_s"]),
        "tau": report.get("tau"), "prompt_lookup_tau": report.get("prompt_lookup_tau"),
        "eval_seconds": report.get("seconds"), "acceptance_histogram": report.get("acceptance_histogram"),
        "eval_prompts": None if args.no_eval else args.eval_prompts, "eval_overrides": args.eval_overrides,
        "draft_config": config, "script_args": script_args(args, work, work / "out"),
        "checkpoint": trained["checkpoint"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, required=True, help="train exactly this many steps")
    p.add_argument("--source", type=Path, default=ROOT / ".peer" / "specforge", help="SpecForge's source (40d8fef)")
    p.add_argument("--target", type=Path, default=None, help="the target's model dir (default: as bench/quality/quality.py)")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "quality", help="bench/quality/quality.py's data cache")
    p.add_argument("--work", default=None, help="a new folder for the peer's data, run and evaluation")
    p.add_argument("--name", default=None, help="the result's name (default: specforge-STEPSsteps-sSEED)")
    p.add_argument("--no-eval", action="store_true", help="train only (its step times: a random-weight target of a "
                   "real shape, bench/peers/random_target.py), no evaluation; its checkpoint is deleted")
    p.add_argument("--eval-overrides", nargs="*", default=[], metavar="k=v",
                   help="extra `dflash-train eval` overrides, as the arms it is compared with (target.dtype=...)")
    p.add_argument("--peer-python", default=sys.executable)
    p.add_argument("--batch", type=int, default=16, help="rows per step (bench/peers/peers.py's ModelOpt runs: 16)")
    p.add_argument("--max-length", type=int, default=3072, help="rows cut at this many tokens (its recipe's)")
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=5, help="a spare token id below the vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("random", "target"), default="random",
                   help="target: start from our step-0 drafter made from the target's layers")
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "peers")
    p.add_argument("--out", type=Path, help="also write the result JSON here")
    p.add_argument("peer_args", nargs="*", help="after --: more of the script's own arguments (--num-anchors 80 ...)")
    args = p.parse_args(argv)
    if args.target is None:
        from bench.quality.quality import default_target

        args.target = default_target()
    args.target, args.source, args.cache = args.target.resolve(), args.source.resolve(), args.cache.resolve()
    if not (args.source / "scripts" / "train_dflash.py").is_file():
        raise SystemExit(f"no scripts/train_dflash.py under {args.source} (bench/README.md: fetch SpecForge 40d8fef)")
    result = specforge(args)
    write_result(result, "peers", result["name"], args.results, args.out)
    print(TABLE_HEADER)
    print(table_row(result))
    print(json.dumps({k: result[k] for k in ("name", "tau", "prompt_lookup_tau", "steps", "real_tokens_per_s",
                                             "step_s_after_warmup", "step_s_median", "step_s_without_slow",
                                             "slow_steps") if k in result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
