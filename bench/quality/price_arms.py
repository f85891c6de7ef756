"""Set an arms file's step counts from step prices measured in the same call: equal GPU time per arm.

Each arm named `<label>-<minutes>-<rest>` (e.g. `d2-5-s0`) gets `train.max_steps = minutes * 60 / step_s`, where
step_s is the measured step of its drafter variant (`drafter.variant=...` on its line, else dflash) at the priced
shape, read from `bench/speed/run.py` JSONs (`--set drafter.variant=...` in their command names the variant; with
`--set train.optimizer=muon` it is priced apart, as `<variant>+muon`), over
`train.grad_accum` when the arm sets it (each of its steps trains that many priced batches). An arm that sets
`pipeline.token_budget=N` takes the price measured at N tokens a step when there is one (Muon's Newton-Schulz costs
the same per optimizer step whatever its tokens, so a bigger step is priced, not scaled), else the variant's price:

    python bench/quality/price_arms.py --arms bench/quality/arms/dflash2-8b.txt --prices /tmp/suite-results --out /tmp/arms.txt

A variant with no price keeps the arm's written step count (and says so): equal target tokens instead of equal time.
`--price-as LABEL=KEY` prices the arms labelled LABEL as variant KEY (a model scaled down to the practice target, priced
at its 8B size). `--bar-price VARIANT=SECONDS` rescales every price so that VARIANT's is SECONDS: arms compared with
a bar trained in an earlier call, priced on another card, get that bar's GPU time (the ratios of this call's prices).
"""
import argparse
import glob
import json
import re
from pathlib import Path


def variant_of(text: str) -> str:
    """The drafter variant, `/h<N>` added for a LiLiCorr head of width N and `+muon` under `train.optimizer=muon`
    (each changes the step's price)."""
    found = re.search(r"drafter\.variant=(\S+)", text)
    variant = found.group(1) if found else "dflash"
    width = re.search(r"drafter\.lilicorr_hidden_size=(\d+)", text)
    variant += f"/h{width.group(1)}" if width else ""
    return f"{variant}+muon" if re.search(r"train\.optimizer=muon\b", text) else variant


def step_prices(folder: Path) -> dict[str, float]:
    """Seconds per step for each variant priced by a `run.py` JSON in folder (the newest wins), under the variant's
    name and under `<variant>@<token budget>`; a variant's plain name keeps its smallest priced budget's price."""
    prices, budgets = {}, {}
    for path in sorted(glob.glob(str(folder / "*-run-*.json"))):
        result = json.loads(Path(path).read_text())
        if result.get("status") == "ok" and result.get("step_ms"):
            variant, budget = variant_of(result["command"]), result.get("token_budget")
            prices[f"{variant}@{budget}"] = result["step_ms"] / 1e3
            if budget is None or budget <= budgets.get(variant, budget):
                prices[variant], budgets[variant] = result["step_ms"] / 1e3, budget
    return prices


def priced_line(line: str, prices: dict[str, float], price_as: dict[str, str]) -> str:
    if line.startswith("#") or not line.strip():
        return line
    name, *overrides = line.split()
    label, minutes = name.split("-")[0], int(name.split("-")[1])
    variant = price_as.get(label) or variant_of(line)
    budget = re.search(r"pipeline\.token_budget=(\d+)", line)
    if budget and f"{variant}@{budget.group(1)}" in prices:
        variant = f"{variant}@{budget.group(1)}"
    if variant not in prices:
        print(f"{name}: no price for variant {variant}: keeps its written step count")
        return line
    accum = re.search(r"train\.grad_accum=(\d+)", line)  # a step of N batches costs N priced steps
    steps = round(minutes * 60 / (prices[variant] * (int(accum.group(1)) if accum else 1)))
    overrides = [f"train.max_steps={steps}" if o.startswith("train.max_steps=") else o for o in overrides]
    return " ".join([name, *overrides]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", type=Path, required=True)
    p.add_argument("--prices", type=Path, required=True, help="folder of bench/speed/run.py JSONs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--price-as", action="append", default=[], metavar="LABEL=KEY",
                   help="price the arms labelled LABEL at another priced variant KEY (e.g. lcv=lilicorr/h1024: a head "
                        "a quarter of the 8B drafter's width, trained on the practice target at a quarter of its own)")
    p.add_argument("--bar-price", metavar="VARIANT=SECONDS",
                   help="rescale every price so that VARIANT's is SECONDS (e.g. dflash2=0.2392: the H200 price an "
                        "earlier bar's step counts came from)")
    args = p.parse_args()
    prices = step_prices(args.prices)
    if args.bar_price:
        bar, seconds = args.bar_price.split("=", 1)
        if bar not in prices:
            raise SystemExit(f"--bar-price {args.bar_price}: {bar} has no price here (priced: {sorted(prices)})")
        scale = float(seconds) / prices[bar]
        prices = {k: v * scale for k, v in prices.items()}
    print(f"step seconds: {prices}")
    price_as = dict(item.split("=", 1) for item in args.price_as)
    lines = [priced_line(line, prices, price_as) for line in args.arms.read_text().splitlines(keepends=True)]
    args.out.write_text("".join(lines))
    print("".join(line for line in lines if not line.startswith("#")), end="")


if __name__ == "__main__":
    main()
