"""A random-weight target checkpoint of a preset's shape with a given tokenizer, written to disk: for a trainer
that only reads checkpoints (the peer's example), so that its step time can be measured at a real target's shape.

    python bench/peers/random_target.py --preset qwen3-8b --tokenizer .practice/model --out /tmp/qwen3-8b-random

The weights are random (the model's own init), in bf16, built on the GPU when there is one; the tokenizer and
chat template are copied from `--tokenizer` (its ids must lie below the preset's vocabulary). Speed only: such a
target's replies mean nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash_trainer.target.presets import PRESETS, preset_config  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    p.add_argument("--tokenizer", type=Path, required=True, help="a model folder whose tokenizer files are copied")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers (a CPU check of the path)")
    args = p.parse_args(argv)
    config = preset_config(args.preset)
    if args.num_layers:
        config.num_hidden_layers = args.num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: args.num_layers]
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"--tokenizer has {len(tokenizer)} tokens, more than {args.preset}'s {config.vocab_size}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).is_file():
            shutil.copy(args.tokenizer / name, args.out / name)
    print(f"wrote {args.out}: {args.preset} shape, {sum(t.numel() for t in model.parameters()) / 1e9:.2f}B "
          f"random parameters (bf16, {device}), the tokenizer of {args.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
