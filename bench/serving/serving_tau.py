"""Acceptance length of a drafter served by vLLM and SGLang, against `dflash-train eval` on the same prompts (GPU).

    python bench/serving/serving_tau.py --config RECIPE --drafter EXPORT [--speculators-drafter EXPORT2]
        [--prompts eval_prompts.jsonl] [--num-prompts 40] [--max-new-tokens 128]
        [--engines vllm,sglang] [--vllm-python PY] [--sglang-python PY] [--out DIR] [--dry-run] [overrides ...]

The recipe (a run's config.yaml, or configs/practice.yaml with `target.path=`) gives the target, the chat template
and thinking mode, as `dflash-train eval` reads them. The prompts are rendered and tokenized once, as `dflash-train
eval` does, and sent to each server as token ids, greedy, with the same stop tokens and budget; each server is
started with the serving command of docs/serving.md (bench/serving/serving_engines.py), one at a time, and its mean
acceptance length read from its own counters. Then `dflash-train eval` measures ours on the same prompts. A served drafter that
matches our forward (scripts/serving-check.sh) should give about our tau: in bf16, verifying a block rounds
differently from one-token steps, so near-tied argmaxes can flip and the figures differ a little.

The engines need a GPU and usually their own environments (their torch pins differ): --vllm-python and
--sglang-python name interpreters that have them. --dry-run (any machine) renders the prompts and prints the
commands without starting anything. Prints a table and, last, one JSON line; writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import RESULTS, ROOT, free_port, git_commit, write_result  # also puts src/ on sys.path
from bench.serving.serving_engines import measure, optional_float, server_command

from dflash_trainer.config import load_config
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.drafter.export import read_export
from dflash_trainer.eval.evaluate import encode_prompts, load_prompt_messages
from dflash_trainer.target.stop_tokens import stop_token_ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the recipe: target, chat template, thinking (as for eval)")
    p.add_argument("--drafter", required=True, help="a --format dflash export")
    p.add_argument("--speculators-drafter", help="the same drafter exported --format speculators (vLLM only)")
    p.add_argument("--prompts", help="JSONL of {messages}: held-out prompts (default: the recipe's eval.prompts)")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engines", default="vllm,sglang")
    p.add_argument("--vllm-python", default=sys.executable)
    p.add_argument("--sglang-python", default=sys.executable)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to start")
    p.add_argument("--out", default=str(RESULTS / "serving"))
    p.add_argument("--dry-run", action="store_true", help="render the prompts and print the commands only")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe (e.g. target.path=...)")
    return p.parse_args(argv)


def prompt_ids(config, args) -> tuple[list[list[int]], list[int]]:
    """The prompts as `dflash-train eval` renders them, and its stop tokens (the target's model is not loaded)."""
    from transformers import GenerationConfig

    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    messages = load_prompt_messages(args.prompts, args.num_prompts)
    encoded, _ = encode_prompts(tokenizer, messages, thinking=config.data.thinking,
                                max_prompt_tokens=config.data.max_length - args.max_new_tokens)  # text prompts
    generation = types.SimpleNamespace(generation_config=GenerationConfig.from_pretrained(config.target.path))
    return [p.tolist() for p in encoded], stop_token_ids(tokenizer, generation)


def our_tau(args, out: Path) -> dict:
    """`dflash-train eval` on the same prompts, budget and greedy decoding; its eval.json."""
    command = [sys.executable, "-m", "dflash_trainer", "eval", "--drafter", args.drafter, "--config", args.config,
               "--out", str(out), f"eval.prompts={args.prompts}", f"eval.num_prompts={args.num_prompts}",
               f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperature=0.0", *args.overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"tau": None, "error": (proc.stderr.strip().splitlines() or ["dflash-train eval failed"])[-1]}
    report = json.loads((out / "eval.json").read_text())
    return {"tau": report["tau"], "steps": report["steps"], "tokens": report["tokens_generated"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    args.prompts = args.prompts or config.eval.prompts
    if not args.prompts:
        raise SystemExit("give --prompts (held-out prompts) or set eval.prompts in the recipe")
    spec, _ = read_export(args.drafter)
    prompts, stop_ids = prompt_ids(config, args)
    served = []  # (engine, format, interpreter, export)
    for engine in [e for e in args.engines.split(",") if e]:
        python = args.vllm_python if engine == "vllm" else args.sglang_python
        served.append((engine, "dflash", python, args.drafter))
        if engine == "vllm" and args.speculators_drafter:
            served.append((engine, "speculators", python, args.speculators_drafter))
    command = lambda engine, fmt, python, export, port: server_command(
        engine, fmt, python=python, target=config.target.path, export=str(Path(export).resolve()),
        block_size=spec.block_size, port=port, dtype=str(config.target.dtype).removeprefix("torch."),
        max_model_len=config.data.max_length)
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), stop ids {stop_ids}, block {spec.block_size}, "
          f"max_new_tokens {args.max_new_tokens}")
    if args.dry_run:
        for engine, fmt, python, export in served:
            print(f"{engine} {fmt}: " + " ".join(command(engine, fmt, python, export, 30000)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for engine, fmt, python, export in served:
        port = free_port()
        rows[f"{engine} {fmt}"] = measure(
            engine, command(engine, fmt, python, export, port), port=port, log=out / f"{engine}-{fmt}.log",
            target=config.target.path, prompts=prompts, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids,
            concurrency=args.concurrency, ready_timeout_s=args.ready_timeout)
    rows["dflash-train eval"] = our_tau(args, out / "ours")
    ours = rows["dflash-train eval"]["tau"]
    print(f"{'who':<22} {'tau':>7} {'vs ours':>8} {'steps':>8} {'tokens':>8}  error")
    for who, r in rows.items():
        ratio = None if r.get("tau") is None or not ours else r["tau"] / ours
        print(f"{who:<22} {optional_float(r.get('tau')):>7} {optional_float(ratio):>8} "
              f"{optional_float(r.get('steps'), '{:.0f}'):>8} {optional_float(r.get('tokens'), '{:.0f}'):>8}  "
              f"{r.get('error', '')}")
    result = {"bench": "serving_tau", "commit": git_commit(), "config": args.config, "drafter": args.drafter,
              "prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "block_size": spec.block_size, "rows": rows}
    write_result(result, "serving_tau", Path(args.drafter).resolve().name, out)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
