"""What crosses between the check and its engine processes: a `Job` per (drafter, format), an `EngineResult` per
(job, engine), both JSON in the work folder. Each engine runs in its own process (vLLM and SGLang both set up
torch.distributed and process-wide state), so the check itself never imports an engine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ENGINES = ("vllm", "sglang")
FORMATS = ("dflash", "speculators")


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One export to load in every engine and compare with our forward."""

    id: str
    """`drafter/format`, e.g. `all-full/speculators`; also the name of its output files."""
    variant: str
    """The drafter variant (`variants.VARIANTS` key): which engine classes must load it."""
    drafter: str
    """all-full | all-sliding | mixed | given (an export passed with --export)."""
    format: str
    """dflash | speculators."""
    export: str
    """The export folder (config.json + model.safetensors)."""
    target: str
    """The target (verifier) folder, a Hugging Face checkpoint: its embedding and LM head are the drafter's."""
    inputs: str
    """A torch file: taps (C, K*H), block_ids (B,), context_positions (C,), block_positions (B,)."""
    block_size: int
    """B: the engine must draft B - 1 tokens after the block's first (vLLM: num_speculative_tokens = B - 1)."""
    vllm_v2_runner: bool = False
    """Build the vLLM drafter as its V2 model runner does (VLLM_USE_V2_MODEL_RUNNER=1): the only runner that
    takes a drafter whose layers mix full and sliding attention, and the runner whose positions the image case feeds."""
    refused: Optional[str] = None
    """Set when our exporter refused to write this format for this drafter (the engines skip the job)."""
    conversation: Optional[str] = None
    """The image case (image_case.py): a torch file with the conversation the context comes from, input_ids (S,),
    pixel_values (P, D), image_grid_thw (I, 3), which an engine runs its own target on (vLLM); None for the text
    cases, whose taps are random."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResult:
    """What one engine made of one job."""

    job: str
    engine: str
    status: str
    """ran | not-read (the engine does not read this format) | refused (the engine cannot serve this drafter with this
    target) | error."""
    detail: str = ""
    """The error, why the engine does not read the format, or why it cannot serve the drafter."""
    model_class: str = ""
    """The class the engine's loader built."""
    layers: list = field(default_factory=list)
    """Per drafter layer as the engine resolved it: {"causal": bool, "window": int | None (HF's window, the token
    itself included)}."""
    taps: list = field(default_factory=list)
    """The target layers the engine feeds the drafter, in our numbering (output of decoder layer l), in order."""
    block_size: int = 0
    """The block the engine drafts with."""
    notes: list = field(default_factory=list)
    """Workarounds applied (with what they found), one line each."""
    outputs: str = ""
    """A torch file with the engine's `hidden` (B, H) after the final norm and `logits` (B, V); with a conversation,
    `target_taps` (S, K*H): its own target's aux hidden states of it."""


def write_jobs(path: Path, jobs: list[Job]) -> None:
    path.write_text(json.dumps([asdict(j) for j in jobs], indent=1))


def read_jobs(path: Path) -> list[Job]:
    return [Job(**j) for j in json.loads(path.read_text())]


def write_results(path: Path, results: list[EngineResult]) -> None:
    path.write_text(json.dumps([asdict(r) for r in results], indent=1))


def read_results(path: Path) -> list[EngineResult]:
    return [EngineResult(**r) for r in json.loads(path.read_text())]
