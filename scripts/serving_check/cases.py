"""The check's inputs: a tiny random Qwen3 target saved as a Hugging Face folder (the verifier), tiny drafters built
with our code (fp32, random weights, norms included, so that a per-layer weight mix-up shows), their exports in each
format, one block's inputs, and our forward on them (the reference the engines must reproduce).

The block is what both engines draft from: context taps at positions 0..C-1 and the block `[token, MASK x (B-1)]`
at positions C..C+B-1. C is longer than the sliding window, so windows cut both the context and the block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from dflash_trainer.drafter.export import load_drafter
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.presets import preset_config
from serving_check.jobs import FORMATS, Job
from serving_check.variants import VARIANTS, Shape, Variant

BLOCK_SIZE = 8
CONTEXT = 11
WINDOW = 4
SHAPES = (
    Shape(name="all-full", num_layers=3),
    Shape(name="all-sliding", num_layers=3, sliding_layers=(0, 1, 2), sliding_window=WINDOW),
    Shape(name="mixed", num_layers=3, sliding_layers=(1,), sliding_window=WINDOW),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """What an engine must reproduce for one job: our forward and how we trained each layer."""

    hidden: torch.Tensor
    """(B, H) our final hidden states of the block."""
    layers: list
    """Per layer {"causal": bool, "window": int | None}: full attention non-causal, sliding layers causal."""
    taps: list
    """Our tap layer ids (output of decoder layer l), in the order `fc` reads them."""
    selector: Optional[dict] = None
    """DFlash2: our `candidates` (B-1, K) and `lattice` (B-1, K, K) (variants.py); LiLiCorr: those and our walk's
    `picks` (B-1,); None for DFlash."""
    walk: Optional[dict] = None
    """DSpark: our Markov walk's `drafts` (B,) and `scores` (B, V) (variants.py); None for the other variants."""
    target_taps: Optional[torch.Tensor] = None
    """(S, K*H) our capture of the job's conversation (the image case, image_case.py), which an engine's own target
    must reproduce; None for the text cases (random taps)."""


def reference_of(drafter, hidden: torch.Tensor, selector: Optional[dict] = None, walk: Optional[dict] = None,
                 target_taps: Optional[torch.Tensor] = None) -> Reference:
    spec = drafter.spec
    layers = [{"causal": spec.layer_window(i) is not None, "window": spec.layer_window(i)}
              for i in range(spec.num_layers)]
    return Reference(hidden=hidden, layers=layers, taps=list(spec.tap_layer_ids), selector=selector, walk=walk,
                     target_taps=target_taps)


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    path: str
    embed: torch.Tensor
    """(V, H) the target's input embedding: the drafter embeds its block with it."""
    head: torch.Tensor
    """(V, H) the target's LM head: logits of the drafter's hidden states."""


def make_target(folder: Path, seed: int = 3) -> tuple[Target, object]:
    """The tiny Qwen3 preset with random weights, saved to `folder`; returns it and its HF config."""
    config = preset_config("tiny")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return read_target(folder), config


EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
"""The input embedding's name in a causal LM's checkpoint, and in an image-text one's (Qwen3-VL)."""


def read_target(folder: Path) -> Target:
    weights = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    embed = next((weights[k] for k in EMBED_NAMES if k in weights), None)
    if embed is None or "lm_head.weight" not in weights:
        raise ConfigError(f"target {folder}: no input embedding ({' or '.join(EMBED_NAMES)}) or no lm_head.weight in "
                          "its safetensors; give a Qwen3-style checkpoint folder (untied embedding and LM head)")
    return Target(path=str(folder), embed=embed, head=weights["lm_head.weight"])


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random: projections ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.3^2) (our init sets norms to 1,
    which would hide an engine that applies one layer's norm weight to another)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)


def make_inputs(spec, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    token = int(torch.randint(0, spec.mask_token_id, (1,), generator=gen))
    return {
        "taps": torch.randn(CONTEXT, spec.num_taps * spec.hidden_size, generator=gen),  # (C, K*H)
        "block_ids": torch.tensor([token] + [spec.mask_token_id] * (spec.block_size - 1)),  # (B,)
        "context_positions": torch.arange(CONTEXT),
        "block_positions": torch.arange(CONTEXT, CONTEXT + spec.block_size),
    }


def build_jobs(work: Path, variants: list[Variant], target: Target, target_config, *, shapes=SHAPES,
               formats=FORMATS, old_speculators_field: bool = False) -> tuple[list[Job], dict[str, Reference]]:
    """Build, export and run our forward for each variant and shape; returns the jobs and our reference per job."""
    jobs, ours = [], {}
    for variant in variants:
        for i, shape in enumerate(shapes):
            name = f"{variant.name}-{shape.name}"
            drafter = variant.build(shape, BLOCK_SIZE, target_config)
            randomize(drafter, seed=10 + i)
            inputs = make_inputs(drafter.spec, seed=20 + i)
            torch.save(inputs, work / f"{name}-inputs.pt")
            with torch.no_grad():
                hidden = variant.reference(drafter, inputs, target.embed)
                selector = variant.selector and variant.selector(drafter, hidden, target.head,
                                                                 int(inputs["block_ids"][0]))
                selector = selector or (variant.lattice and variant.lattice(drafter, hidden, inputs, target))
                walk = variant.walk and variant.walk(drafter, hidden, target.head, int(inputs["block_ids"][0]))
            for fmt in formats:
                out, refused = work / f"{name}-{fmt}", None
                try:
                    variant.exporters[fmt](drafter, str(out), target.path, target_config)
                    if fmt == "speculators" and old_speculators_field:
                        _write_old_causality_field(out)
                except ConfigError as e:
                    refused = str(e)
                mixed = 0 < len(shape.sliding_layers) < shape.num_layers
                jobs.append(Job(id=f"{variant.name}/{shape.name}/{fmt}", variant=variant.name, drafter=shape.name,
                                format=fmt, export=str(out), target=target.path, inputs=str(work / f"{name}-inputs.pt"),
                                block_size=BLOCK_SIZE, refused=refused,
                                vllm_v2_runner=mixed or variant.selector is not None or variant.walk is not None
                                or variant.lattice is not None))
                ours[jobs[-1].id] = reference_of(drafter, hidden, selector, walk)
    return jobs, ours


def _write_old_causality_field(export: Path) -> None:
    """What our speculators export wrote before issue 53's fix: `sliding_window_non_causal: false` whatever the
    layers, which vLLM turns into `causal: true` for every layer."""
    path = export / "config.json"
    config = json.loads(path.read_text())
    config["sliding_window_non_causal"] = False
    path.write_text(json.dumps(config, indent=2))


def given_job(work: Path, export: Path, reference: Path, target_dir: Path | None
              ) -> tuple[Job, dict[str, Reference], Target]:
    """A job for an existing export folder, against our forward of a dflash-format `reference` export of the same
    drafter (its variant: the reference's). The target is `target_dir`, or the verifier folder a speculators
    export names."""
    config = _read_config(export, "--export")
    fmt = "speculators" if "speculators_model_type" in config else "dflash"
    if target_dir is None:
        verifier = (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
        if not verifier or not Path(verifier).is_dir():
            named = f" (its verifier, {verifier!r}, is no local folder)" if fmt == "speculators" else ""
            raise ConfigError(f"--export {export}: give --target FOLDER, the target checkpoint folder whose embedding "
                              f"and LM head the drafter uses{named}")
        target_dir = Path(verifier)
    _read_config(reference, "--reference")
    drafter = load_drafter(reference, attention="sdpa").float()
    target = read_target(target_dir)
    inputs = make_inputs(drafter.spec, seed=20)
    torch.save(inputs, work / "given-inputs.pt")
    variant = VARIANTS[drafter.spec.variant]
    with torch.no_grad():
        hidden = variant.reference(drafter, inputs, target.embed.float())
        selector = variant.selector and variant.selector(drafter, hidden, target.head.float(),
                                                         int(inputs["block_ids"][0]))
        selector = selector or (variant.lattice and variant.lattice(drafter, hidden, inputs, target))
        walk = variant.walk and variant.walk(drafter, hidden, target.head.float(), int(inputs["block_ids"][0]))
    job = Job(id=f"{variant.name}/given/{fmt}", variant=variant.name, drafter="given", format=fmt, export=str(export),
              target=str(target_dir), inputs=str(work / "given-inputs.pt"), block_size=drafter.spec.block_size,
              vllm_v2_runner=len(set(drafter.spec.layer_types)) > 1 or variant.selector is not None
              or variant.walk is not None or variant.lattice is not None)
    return job, {job.id: reference_of(drafter, hidden, selector, walk)}, target


def _read_config(folder: Path, flag: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {folder}: cannot read its config.json ({type(e).__name__}: {e}); give an export "
                          "folder (config.json + model.safetensors)") from None
