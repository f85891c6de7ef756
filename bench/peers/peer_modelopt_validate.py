"""The peer's own acceptance measurement on its trained model: ModelOpt's `validate_ar` (the example's
`scripts/ar_validate.py`, online validation: the target's ground truth recomputed after each accepted draft token)
on our held-out prompts instead of MT-Bench (the device machine has no hub). Runs in the peer's Python; called by
`bench/peers/peers.py --peer-validate N`.

    python bench/peers/peer_modelopt_validate.py --example DIR --model OUT_DIR --prompts eval.jsonl --out FILE.json \\
        [--num-samples 40] [--steps 15] [--osl 128]

Writes the mean acceptance it reports (its AR: accepted draft tokens per step, as its script prints), the number of
prompts and its settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_user_turns(path: Path, limit: int) -> list[dict]:
    """`validate_ar`'s dataset rows ({"prompt": [text]}) from our eval prompt file's first user turns."""
    rows = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        messages = record.get("messages") or record.get("conversations") or []
        text = next((m.get("content") or m.get("value") for m in messages if m.get("role", m.get("from")) in
                     ("user", "human")), None)
        if text:
            rows.append({"prompt": [text], "category": "held-out"})
        if len(rows) == limit:
            break
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--example", type=Path, required=True, help="ModelOpt's examples/speculative_decoding folder")
    p.add_argument("--model", type=Path, required=True, help="the trained model folder (the example's output_dir)")
    p.add_argument("--prompts", type=Path, required=True, help="held-out prompts (JSONL of messages)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-samples", type=int, default=40)
    p.add_argument("--steps", type=int, default=15, help="draft tokens per step (block size - 1)")
    p.add_argument("--osl", type=int, default=128, help="new tokens per prompt")
    args = p.parse_args()
    sys.path.insert(0, str(args.example.resolve()))
    import modelopt.torch.opt as mto
    import torch
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from scripts.ar_validate import validate_ar
    from transformers import AutoTokenizer

    mto.enable_huggingface_checkpointing()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_vlm_or_llm(str(args.model), device_map=str(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    rows = first_user_turns(args.prompts, args.num_samples)
    results = validate_ar(model, tokenizer, rows, steps=args.steps, osl=args.osl, num_samples=len(rows), device=device)
    ars = [ar for _, ar in results]
    summary = {"validator": "modelopt validate_ar (online)", "mean_ar": sum(ars) / len(ars) if ars else None,
               "prompts": len(rows), "scored": len(ars), "steps": args.steps, "osl": args.osl}
    args.out.write_text(json.dumps(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
