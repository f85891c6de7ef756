"""Whether a target is one a drafter fits: the sizes a drafter takes from the target it was made for, and the marks of
a drafter (not a target) in a model's config. `eval` checks a loaded target with it, `export` the verifier it records.
"""

from __future__ import annotations

from typing import Any, Optional

from dflash_trainer.drafter.spec import DrafterSpec


def target_mismatches(spec: DrafterSpec, *, hidden_size: int, vocab_size: int,
                      num_layers: Optional[int]) -> list[str]:
    """Each size of a target (`num_layers` None: not known) that differs from the one `spec`'s drafter was made
    for, as `name TARGET'S (the drafter's: ITS)`: a drafter runs on its target's embedding, LM head and taps, so a
    target of another hidden size, vocabulary or depth (its taps were chosen for that depth) is another model."""
    taps = f", taps {list(spec.tap_layer_ids)}" if num_layers is not None and num_layers - 1 <= max(spec.tap_layer_ids) \
        else ""
    made_for = {"hidden_size": (hidden_size, spec.hidden_size, ""),
                "vocab_size": (vocab_size, spec.vocab_size, ""),
                "decoder layers": (num_layers, spec.num_target_layers, taps)}
    return [f"{name} {theirs} (the drafter's: {ours}{more})" for name, (theirs, ours, more) in made_for.items()
            if theirs is not None and theirs != ours]


def drafter_marks(config: dict[str, Any]) -> Optional[str]:
    """What in a model's config.json says it is a drafter (a DFlash, speculators or EAGLE-style export), not a
    target; None when nothing does."""
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    drafters = [a for a in architectures if a.endswith("DraftModel") or a.startswith(("DFlash", "Eagle"))]
    if drafters:
        return f"architectures {drafters}"
    for key in ("speculators_model_type", "dflash_config"):
        if key in config:
            return f"its {key}"
    return None


GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
"""How the model classes that generate text end (transformers' causal LMs and image-text-to-text models): what an
engine serves as the target a drafter drafts for."""


def not_generative(architectures: list[str]) -> Optional[str]:
    """The classes, in words, when a config names classes and none of them generates text (an encoder such as
    BertModel, a classifier); None otherwise."""
    named = [a for a in architectures if isinstance(a, str)]
    if named and not any(a.endswith(GENERATIVE_SUFFIXES) for a in named):
        return f"architectures {named}"
    return None
