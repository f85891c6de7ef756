"""The peer's own drafts for a few prompts: ModelOpt's `pseudo_speculative_generate` on its trained model (DFlash,
or DSpark with its Markov head), the target in fp32, written as JSON for `bench/peers/drafts_parity.py` to compare
with what `dflash-train eval` drafts from the same model's export. Runs in the peer's Python.

    python bench/peers/peer_modelopt_drafts.py --model OUT_DIR --prompts prompts.json --out drafts.json --steps 15 \
        [--markov-scale X]

`prompts.json`: {"prompts": [[token ids], ...]}. Writes {"steps": S, "rows": [{"anchor": id, "drafts": [ids]}]}:
the anchor is the target's greedy next token after the prompt (the first generated token), the drafts the S tokens
ModelOpt proposes after it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the trained model folder (the example's output_dir)")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="draft tokens to ask for (a block's)")
    p.add_argument("--markov-scale", type=float, default=1.0,
                   help="multiply a DSpark module's markov_w2 by this first (drafts_parity.py scales the export's too)")
    args = p.parse_args()
    import modelopt.torch.opt as mto
    import torch
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    mto.enable_huggingface_checkpointing()
    model = load_vlm_or_llm(str(args.model), dtype=torch.float32, device_map="cpu").eval()
    if args.markov_scale != 1.0:
        with torch.no_grad():
            model.dflash_module.markov_w2.weight.mul_(args.markov_scale)
    rows = []
    with torch.no_grad():
        for ids in json.loads(args.prompts.read_text())["prompts"]:
            anchor, drafts = model.pseudo_speculative_generate(torch.tensor([ids]), steps=args.steps)
            rows.append({"anchor": int(anchor[0, 0]), "drafts": drafts[0].tolist()})
    args.out.write_text(json.dumps({"steps": args.steps, "rows": rows}))
    print(json.dumps({"rows": len(rows), "steps": args.steps}))


if __name__ == "__main__":
    main()
