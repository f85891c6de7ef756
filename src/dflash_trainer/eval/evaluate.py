"""Acceptance length (tau) over a prompt set: speculative decoding against plain target decoding."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from dflash_trainer.errors import DataError
from dflash_trainer.eval.speculative import Proposer, speculative_generate, target_generate

TAU_NOTE = (
    "tau = committed tokens per target verification step (bonus token included), averaged over every step of "
    "every prompt, the last step included even when max_new_tokens or a stop token cut it short; the first "
    "token (from the prefill) is not a verification step"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalReport:
    tau: float
    acceptance_histogram: list[int]
    """Entry k-1 counts the verification steps that committed k tokens (k = 1..block_size)."""
    prompts: int
    tokens_generated: int
    steps: int
    block_size: int
    temperature: float
    target_tokens_per_s: Optional[float]
    speculative_tokens_per_s: float
    greedy_match_rate: Optional[float]
    """Fraction of prompts whose speculative output equals plain target decoding (temperature 0 only)."""
    note: str = TAU_NOTE

    def to_json(self) -> dict:
        return asdict(self)


def load_prompt_messages(path: str | Path, num_prompts: int) -> list[list[dict]]:
    """Messages up to and including the last user turn of each JSONL row `{"messages": [...]}`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval prompts file {path} not found; set eval.prompts to a JSONL of {{\"messages\": [...]}} rows")
    prompts: list[list[dict]] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{line_no}: not a {{\"messages\": [...]}} row with a user turn ({e})") from None
            prompts.append([{"role": m["role"], "content": m["content"]} for m in messages[: last_user + 1]])
            if len(prompts) >= num_prompts:
                break
    if not prompts:
        raise DataError(f"eval prompts file {path} holds no prompt")
    return prompts


def encode_prompts(tokenizer, prompts: Sequence[list[dict]], *, thinking: bool, max_prompt_tokens: int) -> list[torch.Tensor]:
    encoded = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
        encoded.append(torch.tensor(ids, dtype=torch.int64))
    return encoded


def evaluate_tau(
    target,
    proposer: Proposer,
    prompts: Sequence[torch.Tensor],
    *,
    block_size: int,
    tap_layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    seed: int = 0,
    with_baseline: bool = True,
) -> EvalReport:
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    histogram = [0] * block_size
    tokens = steps = matches = 0
    spec_s = base_s = 0.0
    base_tokens = 0
    for prompt in prompts:
        prompt = prompt.to(device)
        out = speculative_generate(
            target, proposer, prompt, block_size=block_size, tap_layer_ids=tap_layer_ids,
            max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, temperature=temperature, generator=generator,
        )
        for length in out.acceptance_lengths:
            histogram[length - 1] += 1
        steps += len(out.acceptance_lengths)
        tokens += len(out.output_ids)
        spec_s += out.seconds
        if with_baseline:
            ref = target_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                  temperature=temperature, generator=generator)
            base_s += ref.seconds
            base_tokens += len(ref.output_ids)
            matches += int(ref.output_ids == out.output_ids)
    committed = sum((k + 1) * c for k, c in enumerate(histogram))
    return EvalReport(
        tau=committed / steps if steps else 0.0,
        acceptance_histogram=histogram,
        prompts=len(prompts),
        tokens_generated=tokens,
        steps=steps,
        block_size=block_size,
        temperature=temperature,
        target_tokens_per_s=base_tokens / base_s if with_baseline and base_s > 0 else None,
        speculative_tokens_per_s=tokens / spec_s if spec_s > 0 else 0.0,
        greedy_match_rate=matches / len(prompts) if with_baseline and temperature <= 0 and prompts else None,
    )


def format_report(report: EvalReport) -> str:
    rows = [
        ("tau", f"{report.tau:.3f}"),
        ("prompts", str(report.prompts)),
        ("verification steps", str(report.steps)),
        ("tokens generated", str(report.tokens_generated)),
        ("block size", str(report.block_size)),
        ("temperature", str(report.temperature)),
        ("speculative tokens/s", f"{report.speculative_tokens_per_s:.1f}"),
        ("target-only tokens/s", "-" if report.target_tokens_per_s is None else f"{report.target_tokens_per_s:.1f}"),
        ("greedy match rate", "-" if report.greedy_match_rate is None else f"{report.greedy_match_rate:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    hist = " ".join(f"{k + 1}:{c}" for k, c in enumerate(report.acceptance_histogram) if c)
    lines.append(f"{'acceptance histogram':<{width}}  {hist}")
    lines.append(f"note: {report.note}")
    return "\n".join(lines)
