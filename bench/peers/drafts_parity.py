"""Does `dflash-train eval` draft what the peer drafts from the same model? ModelOpt's own `pseudo_speculative_generate`
on its trained model (`peer_modelopt_drafts.py`, in the peer's Python) against our proposer on that model's export
(`load_drafter`, DFlash or DSpark), for the same prompts, both with the target in fp32 on the CPU.

    python bench/peers/drafts_parity.py --peer-python PY --model OUT_DIR --export EXPORT_DIR --target .practice/model \\
        --prompts eval.jsonl [--num-prompts 8] [--markov-scale X] [--out DIR]

`--model` is the example's output folder (what its export was made from; `peers.py` leaves it in its work folder as
`timed/`). Prints each prompt's anchor and how many of the drafts agree; writes
`<date>-peers-drafts-parity-<variant>.json` into --out. Exit status 1 when any draft differs: a drafter the evaluator
reads unlike its trainer would give a tau of another model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: the `bench` package

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from bench.common import git_commit, write_result  # noqa: E402
from dflash_trainer.drafter.export import load_drafter  # noqa: E402
from dflash_trainer.eval.evaluate import encode_prompts, load_prompt_messages  # noqa: E402
from dflash_trainer.eval.speculative import DFlashProposer  # noqa: E402


@torch.no_grad()
def our_drafts(target, drafter, prompt: torch.Tensor, anchor: int) -> list[int]:
    """What our reference proposer drafts after `prompt` (its taps as context) from `anchor`."""
    out = target(prompt[None], output_hidden_states=True)
    taps = torch.cat([out.hidden_states[t + 1][0] for t in drafter.spec.tap_layer_ids], dim=-1)  # (T, K*H)
    proposer = DFlashProposer(drafter, target.get_input_embeddings().weight, target.lm_head.weight,
                              drafter.spec.mask_token_id)
    proposer.add_context(taps, torch.arange(prompt.shape[0]))
    width = drafter.spec.draft_length + 1
    return proposer.propose(anchor, prompt.shape[0], width, 0.0, None).tokens.tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-python", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--export", type=Path, required=True)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="held-out prompts (JSONL of messages)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markov-scale", type=float, default=1.0,
                   help="DSpark: multiply markov_w2 by this on both sides, so each draft hangs on the previous one's "
                        "bias (a drafter trained briefly drafts one token over and over, which checks little)")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts, _ = encode_prompts(tokenizer, load_prompt_messages(args.prompts, args.num_prompts), thinking=False,
                                max_prompt_tokens=args.max_prompt_tokens)  # text prompts: no images
    drafter = load_drafter(args.export).float().eval()
    if args.markov_scale != 1.0:
        drafter.markov_w2.weight.data.mul_(args.markov_scale)
    with tempfile.TemporaryDirectory() as tmp:
        ids, theirs = Path(tmp) / "prompts.json", Path(tmp) / "drafts.json"
        ids.write_text(json.dumps({"prompts": [t.tolist() for t in prompts]}))
        cmd = [args.peer_python, str(ROOT / "bench" / "peers" / "peer_modelopt_drafts.py"), "--model", str(args.model),
               "--prompts", str(ids), "--out", str(theirs), "--steps", str(drafter.spec.draft_length),
               "--markov-scale", str(args.markov_scale)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the peer's drafts failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        peer = json.loads(theirs.read_text())["rows"]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    rows = []
    for prompt, theirs in zip(prompts, peer):
        anchor = int(target(prompt[None]).logits[0, -1].argmax())
        ours = our_drafts(target, drafter, prompt, anchor)
        agree = sum(a == b for a, b in zip(ours, theirs["drafts"]))
        rows.append({"anchor": anchor, "peer_anchor": theirs["anchor"], "ours": ours, "peer": theirs["drafts"],
                     "agree": agree})
        print(f"anchor {anchor} (peer {theirs['anchor']}): {agree} of {len(ours)} drafts agree")
    same = all(r["anchor"] == r["peer_anchor"] and r["ours"] == r["peer"] for r in rows)
    result = {"bench": "peers", "check": "drafts_parity", "variant": drafter.spec.variant,
              "draft_length": drafter.spec.draft_length, "prompts": len(rows), "identical": same,
              "drafts_agreeing": sum(r["agree"] for r in rows), "drafts": sum(len(r["ours"]) for r in rows),
              "markov_scale": args.markov_scale, "rows": rows, "export": str(args.export), "commit": git_commit()}
    print(json.dumps({k: result[k] for k in ("variant", "prompts", "identical", "drafts_agreeing", "drafts")}))
    if args.out is not None:
        write_result(result, "peers", f"drafts-parity-{drafter.spec.variant}", args.out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
