"""Run ModelOpt's DFlash training example (`main.py`, fetched into `.peer/`, not part of this repository) under
a wall-clock budget, and record what it trained. Called by `bench/peers/peers.py`; runs in the peer's Python.

    python bench/peers/peer_modelopt_run.py --example DIR --budget-s S --stats FILE.json [--init-weights FILE] \
        -- --config RECIPE [k=v ...]

What is added around the unchanged script, through the `transformers.Trainer` it builds:
- a callback that stops training once `--budget-s` seconds have passed since the first step began (the
  step-count schedule is set by the caller from a calibration run, so the budget is only a guard);
- a count of the real (non-padding) and supervised tokens of every training batch, summed on the device (no host
  sync).
- with `--init-weights`, the draft module's weights from a DFlash-layout safetensors file, loaded once the
  trainer holds the converted model (before the first step); every draft tensor must be there with its shape,
  except the rotary buffers, the embedding / LM head it takes from the target, and a DSpark module's heads (they
  keep the peer's own initialisation).
`--stats` gets: steps, seconds from the first step to the last, real, padded and supervised tokens, step times.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path


HEADS = ("markov_w1.", "markov_w2.", "gate_proj.", "joint_proj.", "confidence_proj.", "prefix_gru.", "embed_proj.")
"""A DSpark or Domino draft module's head tensors (ModelOpt's names): not in a DFlash-layout file."""


def load_draft_weights(model, path: Path) -> int:
    """Copy the tensors of `path` into `model.dflash_module` (names without the `dflash_module.` prefix);
    returns how many. Anything missing, extra or of another shape raises: half a warm start is a bug."""
    from safetensors.torch import load_file

    draft = model.dflash_module
    own = {k: v for k, v in draft.state_dict().items()  # a DSpark's or Domino's heads keep the peer's initialisation
           if "rotary_emb" not in k and k not in ("embed_tokens.weight", "lm_head.weight")
           and not k.startswith(HEADS)}
    given = load_file(str(path))
    missing, extra = sorted(set(own) - set(given)), sorted(set(given) - set(own))
    shapes = [f"{k} {tuple(given[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in given and given[k].shape != v.shape]
    if missing or extra or shapes:
        raise SystemExit(f"--init-weights {path}: missing {missing[:5]}, unexpected {extra[:5]}, shapes {shapes[:5]}")
    draft.load_state_dict(given, strict=False)  # the rotary buffers stay as built; dtypes cast on copy
    return len(given)


def count_batch(counts: dict, inputs: dict) -> None:
    """Adds a batch's real tokens (its attention mask), padded tokens and supervised tokens (its `loss_mask`, else
    its labels other than -100: the reply positions the loss can use) to `counts`; device sums stay on the device."""
    mask = inputs.get("attention_mask")
    if mask is not None:
        real = mask.detach().sum()
        counts["real"] = real if counts["real"] is None else counts["real"] + real
        counts["padded"] += mask.numel()
    supervised = inputs.get("loss_mask")
    if supervised is None and inputs.get("labels") is not None:
        supervised = inputs["labels"] != -100
    if supervised is not None:
        n = supervised.detach().sum()
        counts["loss"] = n if counts["loss"] is None else counts["loss"] + n


def install_hooks(budget_s: float, stats_path: Path, init_weights: Path | None = None) -> None:
    import torch
    from transformers import Trainer, TrainerCallback

    counts: dict = {"real": None, "padded": 0, "loss": None}

    class Budget(TrainerCallback):
        def __init__(self) -> None:
            self.start = None
            self.step_ends: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter() - self.start)
            if self.step_ends[-1] >= budget_s:
                control.should_training_stop = True

        def on_train_end(self, args, state, control, **kwargs):
            # host syncs: once, at the end
            real = int(counts["real"].item()) if counts["real"] is not None else 0
            loss = int(counts["loss"].item()) if counts["loss"] is not None else None
            stats = {"steps": state.global_step, "seconds": self.step_ends[-1] if self.step_ends else 0.0,
                     "real_tokens": real, "padded_tokens": counts["padded"], "loss_tokens": loss,
                     "step_ends_s": self.step_ends,
                     "budget_s": budget_s, "stopped_by_budget": bool(self.step_ends) and self.step_ends[-1] >= budget_s}
            stats_path.write_text(json.dumps(stats))

    original_init, original_step = Trainer.__init__, Trainer.training_step

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(Budget())
        if init_weights is not None:
            n = load_draft_weights(self.model, init_weights)
            print(f"peer_modelopt_run: draft module initialised from {init_weights} ({n} tensors)", flush=True)

    def training_step(self, model, inputs, *args, **kwargs):
        count_batch(counts, inputs)
        return original_step(self, model, inputs, *args, **kwargs)

    Trainer.__init__, Trainer.training_step = init, training_step
    torch.manual_seed(0)


def python_311_pickling_shim() -> None:
    """On Python < 3.12 a class made by `dataclasses.make_dataclass` names module `types`, so saving the
    example's training arguments fails to pickle; name the running script instead (3.12 does this itself)."""
    if sys.version_info >= (3, 12):
        return
    import dataclasses

    original = dataclasses.make_dataclass

    def make_dataclass(*args, **kwargs):
        cls = original(*args, **kwargs)
        cls.__module__ = "__main__"
        return cls

    dataclasses.make_dataclass = make_dataclass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--example", type=Path, required=True, help="ModelOpt's examples/speculative_decoding folder")
    p.add_argument("--budget-s", type=float, required=True)
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("--init-weights", type=Path, default=None, help="DFlash-layout safetensors for the draft module")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then main.py's own arguments")
    args = p.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    install_hooks(args.budget_s, args.stats.resolve(), args.init_weights and args.init_weights.resolve())
    python_311_pickling_shim()
    example = args.example.resolve()
    os.chdir(example)
    sys.path.insert(0, str(example))
    sys.argv = [str(example / "main.py"), *rest]
    runpy.run_path(str(example / "main.py"), run_name="__main__")


if __name__ == "__main__":
    main()
