"""Drafter quality on the practice target: regenerate the data (cached), train a recipe for a fixed budget,
then measure real tau on held-out prompts beside prompt lookup on the same prompts.

    python bench/quality/quality.py [--recipe practice] [--name NAME] [--target DIR] [--cache DIR] [override ...]
    python bench/quality/quality.py --arms FILE [--parallel N]   # several runs on one cache, N processes at a time
    python bench/quality/quality.py --record FILE.json   # append a result's row to bench/RESULTS.md

The practice target (`../shared/practice_target/`) was pretrained on the bundled ShareGPT file except its last
500 records: training prompts come from the others, evaluation prompts (the first `--eval-prompts` first user
turns under 1,500 characters, in file order; with `--eval-turns N`, conversations cut after their N-th user
turn, every user turn under 1,500 characters) from those 500 only, leaving out any whose user turn is also a
training user turn (`same_text`: ShareGPT repeats conversations). A record's turns before its first user turn
are left out. Both are answered by the target itself
(`dflash-train regenerate`, the recipe's `regenerate` section); the held-out replies are the validation set
(walk tau) and their prompts the real-tau prompts. The training prompts are answered a second time,
`--sampled-replies` times each at `--sampled-temperature` (`CACHE/sampled`), and runs train on both sources
(`data.sources`, weighted by their sizes: both read whole): sampled replies beside the greedy ones keep the
drafter from memorising them (bench/RESULTS.md, "Sampled replies against memorising"); `--sampled-replies 0`
trains on the greedy ones. `--pack DIR` writes the cache as <= 15 MB parts (to bring it back from a device
machine), `--unpack DIR` restores it from them.

Per run: a JSON in `bench/results/` (and `--out`), and a table row; the last line printed is the JSON.
Arms in parallel share the GPU (the practice target is too small to fill it alone): compare them by steps,
not by wall time; a recipe's time budget is measured alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from datetime import datetime
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import ROOT, append_table_rows, git_commit, or_dash, write_result

from dflash_trainer.eval.stats import plus_minus  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HELD_OUT_RECORDS = 500
"""The practice target never saw the bundled ShareGPT file's last 500 records."""
MAX_PROMPT_CHARS = 1500
PART_BYTES = 15 * 2**20
PLACEHOLDER_REPLY = "(answered again by regeneration)"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
TABLE_HEADER = "| date | commit | name | recipe, overrides | steps | train s | real tau | prompt lookup | ratio | walk tau (held-out) | walk/real | eval s | notes |"


def default_target() -> Path:
    for candidate in (ROOT.parent / "shared" / "practice_target" / "model", ROOT / ".practice" / "model"):
        if candidate.is_dir():
            return candidate
    raise SystemExit("no practice target: pass --target DIR (../shared/practice_target/model)")


def target_overrides(target) -> list[str]:
    """`--target DIR`, or `--target tiny` (a random tiny target and tokenizer: smoke tests of this script)."""
    if str(target) == "tiny":
        return ["target.path=null", "target.random_init=tiny", "target.tokenizer=tiny", "target.dtype=float32",
                "train.dtype=float32"]
    return [f"target.path={target}"]


def same_text(text: str) -> str:
    """A user turn's content up to case and whitespace: what makes two prompts the same one."""
    return " ".join(text.split()).lower()


def split_sharegpt(num_eval: int, max_train: int | None = None, eval_turns: int = 1):
    """(training conversations, evaluation conversations) of the bundled ShareGPT file (`split_conversations`)."""
    from dflash_trainer.data.config import DataSourceConfig
    from dflash_trainer.data.sources import load_source

    loaded = load_source(DataSourceConfig(path="sharegpt"), purpose=None)  # rows as they are: cut below
    records = loaded.report.records_read - loaded.report.dropped.get("truncated_record", 0)
    return split_conversations(loaded.conversations, records - HELD_OUT_RECORDS, num_eval, max_train, eval_turns)


def split_conversations(conversations, first_held: int, num_eval: int, max_train: int | None = None,
                        eval_turns: int = 1):
    """(training conversations, evaluation conversations), as described above: records before `first_held`
    train; `eval_turns` > 1: held-out conversations of at least that many user turns, cut after the last one's
    reply (decoding then answers their last user turn after the target's own earlier replies)."""
    from dflash_trainer.data.types import Conversation

    # Many ShareGPT records open with an assistant turn (a greeting): the prompts start at the first user turn.
    convs = []
    for c in conversations:
        first_user = next((i for i, m in enumerate(c.messages) if m.role == "user"), None)
        if first_user is not None:
            convs.append(Conversation(messages=c.messages[first_user:], source=c.source, source_index=c.source_index))
    train = [c for c in convs if c.source_index < first_held][:max_train]
    # ShareGPT repeats conversations: a held-out prompt whose user turn is also a training user turn is left out
    seen = {same_text(m.content) for c in convs if c.source_index < first_held for m in c.messages if m.role == "user"}
    evals = []
    for c in convs:
        users = [i for i, m in enumerate(c.messages) if m.role == "user"][:eval_turns]
        if (c.source_index >= first_held and len(users) == eval_turns and len(c.messages) > users[-1] + 1
                and all(len(c.messages[i].content) < MAX_PROMPT_CHARS for i in users)
                and not any(same_text(c.messages[i].content) in seen for i in users)):
            evals.append(Conversation(messages=c.messages[: users[-1] + 2], source=c.source,
                                      source_index=c.source_index))
        if len(evals) == num_eval:
            break
    return train, evals


def _write_messages(path: Path, conversations) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": [{"role": m.role, "content": m.content} for m in c.messages]}) + "\n")


def write_prompts(cache: Path, args) -> None:
    """The training and evaluation prompts (`split_sharegpt`), cut after `--prompt-turns` user turns: a
    first-turn regeneration needs only the first (a small file to carry to a machine without the package).
    A prompt file already in the cache is kept."""
    train, evals = split_sharegpt(args.eval_prompts, args.train_conversations, args.eval_turns)
    if args.prompt_turns is not None:
        from dflash_trainer.data.types import Conversation, Message
        from dflash_trainer.regen.turns import limit_turns

        def prompt_only(c):
            """The last user turn ends the prompt; the assistant turns are answered again, so their text is a
            placeholder (a smaller file to carry; an empty turn would drop the row)."""
            c = limit_turns(c, args.prompt_turns)
            last_user = max(i for i, m in enumerate(c.messages) if m.role == "user")
            messages = tuple(m if m.role != "assistant" else Message(role="assistant", content=PLACEHOLDER_REPLY)
                             for m in c.messages[: last_user + 1])
            return Conversation(messages=messages, source=c.source, source_index=c.source_index)

        train = [prompt_only(c) for c in train]
    for name, conversations in (("train_prompts.jsonl", train), ("eval_prompts.jsonl", evals)):
        if (cache / name).is_file():  # put there by hand (e.g. more held-out prompts): it stays
            print(f"kept {cache / name} ({sum(1 for _ in (cache / name).open())} prompts; --eval-prompts, "
                  "--eval-turns and --prompt-turns do not change it)")
        else:
            _write_messages(cache / name, conversations)


def user_turns(path: Path) -> int:
    """The most user turns of any conversation in a JSONL of `{"messages": [...]}` rows: the held-out prompts'
    earlier turns are answered by the target too, as decoding will see them."""
    return max(sum(m["role"] == "user" for m in json.loads(line)["messages"])
               for line in path.open() if line.strip())


def data_parts(args) -> list[str]:
    """The cache's regenerated folders: held-out replies, greedy training replies, sampled ones (if any)."""
    return ["eval", "train"] + (["sampled"] if args.sampled_replies else [])


def part_overrides(args, name: str) -> list[str]:
    """What a folder's regeneration sets beyond the recipe and the command line's `regenerate.*`."""
    if name == "eval":  # every turn of the held-out prompts, answered as decoding will see them
        return [f"regenerate.max_turns={user_turns(Path(args.cache) / 'eval_prompts.jsonl')}"]
    if name == "sampled":
        return [f"regenerate.num_samples={args.sampled_replies}", f"regenerate.temperature={args.sampled_temperature}"]
    return []


def prompts_file(cache: Path, name: str) -> Path:
    """The prompts a regenerated folder answers: the sampled replies answer the training prompts again."""
    return cache / f"{'train' if name == 'sampled' else name}_prompts.jsonl"


def check_sampled(args) -> None:
    """A sampled folder regenerated with other settings is refused, not trained on under these flags."""
    manifest = Path(args.cache) / "sampled" / "manifest.json"
    if not args.sampled_replies or not manifest.is_file():
        return
    settings = json.loads(manifest.read_text()).get("settings", {})
    made = (int(settings.get("num_samples", 1)), float(settings.get("temperature", 0.0)))
    if made != (args.sampled_replies, args.sampled_temperature):
        raise SystemExit(f"{manifest.parent} holds {made[0]} replies a prompt sampled at temperature {made[1]:g}, not "
                         f"--sampled-replies {args.sampled_replies} --sampled-temperature {args.sampled_temperature:g}:"
                         f" pass --sampled-replies {made[0]} --sampled-temperature {made[1]:g}, or remove "
                         f"{manifest.parent} to regenerate it")


def _complete(regen_dir: Path) -> bool:
    manifest = regen_dir / "manifest.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("complete", False)


def prepare_data(args) -> dict:
    """Regenerate the training and evaluation sets unless the cache has them; returns timings and counts."""
    from dflash_trainer import cli
    from dflash_trainer.regen import read_rows

    cache = Path(args.cache)
    info: dict = {"cache": str(cache), "regenerate_s": 0.0}
    parts = data_parts(args)
    check_sampled(args)
    if all(_complete(cache / name) for name in parts) and (cache / "eval.jsonl").is_file():
        info["cached"] = True
    elif args.no_regen:
        missing = [name for name in parts if not list((cache / name).glob("shard_*.jsonl"))]
        if not (cache / "eval.jsonl").is_file() or missing:
            hint = " (or --sampled-replies 0: greedy replies only)" if missing == ["sampled"] else ""
            raise SystemExit(f"--no-regen: {cache} has no regenerated {' or '.join(missing) or 'eval'} data yet"
                             f"{hint}")
        info["cached"] = "partial"
    else:
        info["cached"] = False
        todo = [name for name in parts if not _complete(cache / name)]  # a finished part stays
        if not all(prompts_file(cache, name).is_file() for name in todo):
            write_prompts(cache, args)
        t0 = time.perf_counter()
        for name in todo:
            regen = [o for o in args.overrides if o.startswith(("regenerate.", "run."))]
            rc = cli.main(["regenerate", "--config", args.recipe, "--out", str(cache / name),
                           f"data.path={prompts_file(cache, name)}",
                           *target_overrides(args.target), "data.max_conversations=null", "logging.progress=false",
                           *regen, *part_overrides(args, name)])
            if rc != 0:
                raise SystemExit(f"regenerate {name} failed (rc {rc})")
        info["regenerate_s"] = time.perf_counter() - t0
        rows = list(read_rows(cache / "eval"))
        with (cache / "eval.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps({"messages": row["messages"]}) + "\n")
    info["train_rows"] = _rows(cache / "train")
    if args.sampled_replies:
        info["sampled_rows"] = _rows(cache / "sampled")
    info["eval_rows"] = sum(1 for _ in (cache / "eval.jsonl").open())
    return info


def _rows(regen_dir: Path) -> int:
    return sum(1 for shard in regen_dir.glob("shard_*.jsonl") for _ in shard.open())


def pack(cache: Path, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "quality-cache.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("train", "sampled", "eval", "eval.jsonl"):
            if (cache / name).exists():
                tar.add(cache / name, arcname=name, filter=lambda info: None if info.name.endswith(".lock") else info)
    data = archive.read_bytes()
    archive.unlink()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        part = out / f"quality-cache.tar.gz.part{i // PART_BYTES:02d}"
        part.write_bytes(data[i : i + PART_BYTES])
        parts.append(part.name)
    return parts


def unpack(parts_dir: Path, cache: Path) -> list[str]:
    """Restore the packed folders (and files) the cache does not have; the ones it has stay as they are. Returns
    the names restored."""
    parts = sorted(parts_dir.glob("quality-cache.tar.gz.part*"))
    if not parts:
        return []
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / "quality-cache.tar.gz"
    archive.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        missing = sorted({m.name.split("/")[0] for m in members} - {p.name for p in cache.iterdir()})
        tar.extractall(cache, members=[m for m in members if m.name.split("/")[0] in missing], filter="data")
    archive.unlink()
    return missing


def run_overrides(args, run_dir: Path) -> list[str]:
    """What every run on the cache sets: the target, the data, the held-out prompts, and batches trained in the
    order the target made them (`pipeline.deterministic`), so that a rerun of a seed trains the same batches
    whatever the GPU's sharing or timing (an arm may set it false)."""
    cache = Path(args.cache)
    data = [f"data.path={cache / 'train'}"]
    if args.sampled_replies:  # weighted by their sizes, so both are read whole (data.sources cuts to the weights)
        weight = _rows(cache / "sampled") / max(1, _rows(cache / "train"))
        sources = [{"path": str(cache / "train")}, {"path": str(cache / "sampled"), "weight": round(weight, 6)}]
        data = ["data.path=null", f"data.sources={json.dumps(sources)}"]
    return [*target_overrides(args.target), *data, f"eval.prompts={cache / 'eval.jsonl'}",
            "data.num_eval_conversations=0", f"eval.num_prompts={args.eval_prompts}", f"run.dir={run_dir}",
            "logging.progress=false", "pipeline.deterministic=true"]


def tokenize(args, overrides: list[str]) -> float:
    """`dflash-train plan` once, so that arms running side by side find the tokenized data cached."""
    from dflash_trainer import cli

    t0 = time.perf_counter()
    plan_dir = Path(args.cache) / "plan"
    if cli.main(["plan", "--config", args.recipe, *run_overrides(args, plan_dir), *overrides]) != 0:
        raise SystemExit("dflash-train plan failed")
    return time.perf_counter() - t0


def train_arm(args, name: str, overrides: list[str], data_info: dict) -> dict:
    from dflash_trainer import cli

    run_dir = Path(args.runs) / name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: pick another --name or remove it")
    t0 = time.perf_counter()
    rc = cli.main(["train", "--config", args.recipe, *run_overrides(args, run_dir), *overrides])
    wall = time.perf_counter() - t0
    if not (run_dir / "summary.json").exists():  # refused before it started (its error is printed above)
        raise SystemExit(f"training {name} did not start: dflash-train train exited {rc}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if rc != 0 or summary.get("status") != "ok":
        raise SystemExit(f"training {name} failed: {summary}")
    ev = summary["eval"] or {}
    val = ev.get("val") or {}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [{k: r.get(k) for k in ("step", "eval_tau", "eval_prompt_lookup_tau", "val_walk_tau", "val_loss")}
             for r in rows if "eval_tau" in r]
    eval_json = json.loads((run_dir / "eval.json").read_text())
    tau, lookup, walk = ev.get("tau"), ev.get("prompt_lookup_tau"), val.get("walk_tau")
    return {
        "bench": "quality", "name": name, "date": datetime.now().strftime("%Y-%m-%d"), "commit": git_commit()[:7],
        "recipe": args.recipe, "overrides": overrides, "target": str(args.target), "data": data_info,
        "steps": summary["steps"], "tokens_trained": summary["tokens_trained"], "train_wall_s": round(wall, 1),
        "tau": tau, "tau_stderr": eval_json.get("tau_stderr"), "prompt_lookup_tau": lookup,
        **{k: eval_json.get(k) for k in ("per_prompt_committed", "per_prompt_steps", "setting_digest",
                                         "prompt_lookup_per_prompt_committed", "prompt_lookup_per_prompt_steps")},
        "ratio": tau / lookup if tau and lookup else None,
        "walk_tau": walk, "walk_over_real": walk / tau if walk and tau else None,
        "best_tau": ev.get("best_tau"), "best_step": ev.get("best_step"),
        "greedy_match_rate": ev.get("greedy_match_rate"), "eval_seconds": eval_json.get("seconds"),
        "acceptance_histogram": ev.get("acceptance_histogram"), "val": val, "evals": evals,
        "final_sim_tau": summary.get("final_sim_tau"), "run_dir": str(run_dir),
        "budget_minutes": (yaml.safe_load((run_dir / "config.yaml").read_text())["train"] or {}).get("max_minutes"),
        "tokens_per_s": summary.get("tokens_per_s"), "overall_tokens_per_s": summary.get("overall_tokens_per_s"),
        "train_loop_s": summary["tokens_trained"] / summary["overall_tokens_per_s"]
        if summary.get("overall_tokens_per_s") else None,
    }


def read_arms(path: Path) -> list[list[str]]:
    """A file of runs (bench/quality/arms/): one `NAME override ...` a line; blank lines and # comments skipped."""
    return [shlex.split(line) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def run_parallel(args, arms: list[list[str]]) -> list[dict]:
    """Each arm in its own process (this script on one arm), `--parallel` at a time; logs in the runs dir."""
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    common = ["--recipe", args.recipe, "--target", str(args.target), "--cache", str(args.cache), "--runs", str(runs),
              "--sampled-replies", str(args.sampled_replies), "--sampled-temperature", str(args.sampled_temperature),
              *(["--no-regen"] if args.no_regen else []),
              "--eval-prompts", str(args.eval_prompts), "--results", str(args.results)]
    waiting, running, results = list(arms), [], []
    while waiting or running:
        while waiting and len(running) < args.parallel:
            name, *overrides = waiting.pop(0)
            log = (runs / f"{name}.log").open("w")
            cmd = [sys.executable, __file__, "--name", name, *common, *(["--out", str(args.out)] if args.out else []),
                   *overrides]
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            print(f"started {name}", flush=True)
        time.sleep(2)
        for item in list(running):
            name, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                found = sorted(Path(args.results).glob(f"*-quality-{name}.json"))
                print(f"finished {name}: rc {proc.returncode}" + ("" if found else f" (no result; see {log.name})"),
                      flush=True)
                if found:
                    results.append(json.loads(found[-1].read_text()))
                    print(row(results[-1]), flush=True)
    return results


def row(result: dict, notes: str = "") -> str:
    setting = " ".join([Path(result["recipe"]).stem, *result["overrides"]])
    tau = or_dash(result["tau"]) + plus_minus(result.get("tau_stderr"), digits=2)
    return (f"| {result['date']} | {result['commit']} | {result['name']} | `{setting}` | {result['steps']} | "
            f"{or_dash(result['train_wall_s'], '{:.0f}')} | {tau} | {or_dash(result['prompt_lookup_tau'])} | "
            f"{or_dash(result['ratio'])}x | {or_dash(result['walk_tau'])} | {or_dash(result['walk_over_real'])} | "
            f"{or_dash(result['eval_seconds'], '{:.1f}')} | {notes} |")


def record(path: Path) -> None:
    append_table_rows(RESULTS_MD, TABLE_HEADER, "Drafter quality on the practice target (`bench/quality/quality.py`)",
                      [row(json.loads(path.read_text()))])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides of the training run")
    p.add_argument("--recipe", default="practice")
    p.add_argument("--name", default=None, help="run name (default: the recipe and a timestamp)")
    p.add_argument("--arms", type=Path, help="a file of runs, one `NAME override ...` a line (# comments)")
    p.add_argument("--parallel", type=int, default=1, help="arms run at once, each in its own process")
    p.add_argument("--target", default=None, help="the practice target's model dir, or `tiny` (smoke)")
    p.add_argument("--cache", default=str(ROOT / ".cache" / "quality"))
    p.add_argument("--runs", default=str(ROOT / "runs" / "quality"))
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--eval-turns", type=int, default=1, help="held-out prompts end at this user turn (default: "
                   "the first), their earlier turns answered by the target")
    p.add_argument("--train-conversations", type=int, default=None, help="regenerate at most this many (smoke)")
    p.add_argument("--out", type=Path, help="also write each result JSON here")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "quality", help="where result JSONs go")
    p.add_argument("--pack", type=Path, help="write the data cache as parts into this directory")
    p.add_argument("--unpack", type=Path, help="restore the data cache from parts in this directory")
    p.add_argument("--data-only", action="store_true", help="prepare (and pack) the data, train nothing")
    p.add_argument("--prompts-only", action="store_true",
                   help="write the prompt files into a cache that has none, and stop")
    p.add_argument("--prompt-turns", type=int, default=None, help="keep this many user turns of each training prompt")
    p.add_argument("--sampled-replies", type=int, default=2, help="replies sampled per training prompt beside the "
                   "greedy one, trained on as a second source (0: greedy replies only)")
    p.add_argument("--sampled-temperature", type=float, default=0.8, help="their sampling temperature")
    p.add_argument("--no-regen", action="store_true", help="use the cache as it is, even if regeneration is unfinished")
    p.add_argument("--record", type=Path, help="append the row of this result JSON to bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.eval_turns < 1:
        p.error(f"--eval-turns must be >= 1, got {args.eval_turns}")
    if args.sampled_replies < 0 or (args.sampled_replies and args.sampled_temperature <= 0):
        p.error(f"--sampled-replies {args.sampled_replies} --sampled-temperature {args.sampled_temperature}: "
                "a count >= 0, and a temperature > 0 when sampling (0 replies: greedy data only)")
    if args.record:
        record(args.record)
        return 0
    if args.prompts_only:
        there = [n for n in ("train_prompts.jsonl", "eval_prompts.jsonl") if (Path(args.cache) / n).is_file()]
        if there:
            raise SystemExit(f"--prompts-only: {args.cache} has {' and '.join(there)} already: remove them to write "
                             "them again, or give another --cache")
        write_prompts(Path(args.cache), args)
        return 0
    args.target = args.target or default_target()
    if args.unpack and (restored := unpack(args.unpack, Path(args.cache))):
        print(f"data cache restored from {args.unpack}: {', '.join(restored)}")
    data_info = prepare_data(args)
    print(f"data: {data_info}", flush=True)
    if args.pack:
        print(f"packed: {pack(Path(args.cache), args.pack)}")
    if args.data_only:
        return 0
    if args.arms:
        arms = [arm + args.overrides for arm in read_arms(args.arms)]  # command-line overrides apply to every arm
    else:
        arms = [[args.name or f"{Path(args.recipe).stem}-{datetime.now().strftime('%H%M%S')}", *args.overrides]]
    if args.parallel > 1 and len(arms) > 1:
        print(f"tokenized in {tokenize(args, args.overrides):.1f} s", flush=True)
        results = run_parallel(args, arms)
    else:
        results = []
        for name, *overrides in arms:
            result = train_arm(args, name, overrides, data_info)
            results.append(result)
            write_result(result, "quality", result["name"], args.results, args.out)
            print(TABLE_HEADER)
            print(row(result), flush=True)
    print()
    print(TABLE_HEADER)
    for result in results:
        print(row(result))
    print(json.dumps({"bench": "quality", "runs": [{k: r[k] for k in ("name", "tau", "prompt_lookup_tau", "ratio",
                                                                          "walk_tau", "steps", "train_wall_s")}
                                                    for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
