"""Acceptance length (tau) over a prompt set: batched speculative decoding with the drafter, prompt lookup
(the training-free baseline) on the same prompts, and plain target decoding (the reference output)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from dflash_trainer.data.vision import ImageTokens
from dflash_trainer.errors import DataError
from dflash_trainer.eval.batched import BatchProposer, decode_batch
from dflash_trainer.eval.image_prompts import PromptImages, encode_image_prompt, message_rows
from dflash_trainer.eval.proposers import PromptLookupProposer
from dflash_trainer.eval.speculative import DecodeResult
from dflash_trainer.eval.stats import plus_minus, tau_stderr

TAU_NOTE = (
    "tau = committed tokens per target verification step (bonus token included), averaged over every step of "
    "every prompt, the last step included even when max_new_tokens or a stop token cut it short; the first "
    "token (from the prefill) is not a verification step"
)

GREEDY_MISMATCH_NOTE = (
    "some outputs differ from plain decoding: expected in bf16/fp16, where verifying a block rounds differently "
    "from one-token steps and flips near-tied argmaxes; in fp32 the outputs must match, otherwise it is a bug"
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
    prompt_lookup_tau: Optional[float] = None
    """tau of prompt lookup (n-gram copying, no training) on the same prompts; None when not measured."""
    prompt_lookup_histogram: Optional[list[int]] = None
    tau_stderr: Optional[float] = None
    """Standard error of `tau` over the prompts (steps within one prompt are not independent); None under 2."""
    prompt_lookup_tau_stderr: Optional[float] = None
    per_prompt_committed: Optional[list[int]] = None
    """Tokens the verification steps committed, one entry per prompt in prompt order (the drafter's pass)."""
    per_prompt_steps: Optional[list[int]] = None
    """Verification steps, one entry per prompt in prompt order."""
    prompt_lookup_per_prompt_committed: Optional[list[int]] = None
    """As `per_prompt_committed`, for prompt lookup's pass (so a subset of the prompts gives both taus)."""
    prompt_lookup_per_prompt_steps: Optional[list[int]] = None
    setting_digest: Optional[str] = None
    """What the evaluation ran on (`setting_digest`): two evaluations with the same digest ran the same prompts,
    decoding settings and target, so they can be compared prompt by prompt (`bench/quality/compare.py`)."""
    seconds: float = 0.0
    """Wall time of the whole evaluation (every pass)."""
    note: str = TAU_NOTE

    def to_json(self) -> dict:
        return asdict(self)


def _prompt_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line, read one at a time and bounded like training rows (sources.py):
    a line over `DEFAULT_MAX_RECORD_BYTES` or nested deeper than `MAX_JSON_DEPTH` is an error naming it, found
    before it is held whole or parsed (json's decoder recurses once per level)."""
    from dflash_trainer.data.config import DEFAULT_MAX_RECORD_BYTES
    from dflash_trainer.data.json_records import MAX_JSON_DEPTH, bounded_lines, too_deeply_nested

    with path.open("rb") as f:
        for line_no, raw in enumerate(bounded_lines(f, DEFAULT_MAX_RECORD_BYTES), 1):
            if raw is None:
                raise DataError(f"{path}:{line_no}: a line over {DEFAULT_MAX_RECORD_BYTES} bytes, far more than a "
                                "prompt; remove it or shorten its turns")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"eval prompts file {path} is not UTF-8 text (line {line_no}: {e.reason}); convert "
                                "it to UTF-8") from None
            if not line.strip():
                continue
            if too_deeply_nested(line):
                raise DataError(f"{path}:{line_no}: arrays or objects nested deeper than {MAX_JSON_DEPTH} levels, "
                                "not a {\"messages\": [...]} row; remove the line")
            yield line_no, line


def load_prompt_messages(path: str | Path, num_prompts: int) -> list[list[dict]]:
    """Messages up to and including the last user turn of each JSONL row `{"messages": [...]}`. A user turn may give
    OpenAI-style text and `image_url` parts (read as the data reader reads them: relative paths from the file's
    folder, each image decoded once); their urls come back resolved (an absolute path, or the data URL)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval prompts file {path} not found; set eval.prompts to a JSONL of {{\"messages\": [...]}} rows")
    prompts: list[list[dict]] = []
    for line_no, line in _prompt_lines(path):
        try:
            messages = json.loads(line)["messages"]
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise DataError(f"{path}:{line_no}: not a {{\"messages\": [...]}} row with a user turn ({e})") from None
        prompt = [{"role": m["role"], "content": m.get("content")} for m in messages[: last_user + 1]]
        bad = next((m for m in prompt if not isinstance(m["content"], str)), None)
        if isinstance(bad, dict) and isinstance(bad["content"], list):  # image parts: read as training reads them
            try:
                prompt = [{"role": m.role, "content": m.openai_content()} for m in message_rows(prompt, path.parent)]
            except DataError as e:
                raise DataError(f"{path}:{line_no}: a {bad['role']} turn's content is list, not text or text and "
                                f"image parts: {e}") from None
        elif bad is not None:
            raise DataError(f"{path}:{line_no}: a {bad['role']} turn's content is "
                            f"{type(bad['content']).__name__}, not text; give each turn's content as a string")
        prompts.append(prompt)
        if len(prompts) >= num_prompts:
            break
    if not prompts:
        raise DataError(f"eval prompts file {path} holds no prompt")
    return prompts


def has_image_parts(messages: Sequence[dict]) -> bool:
    """Whether a prompt (as `load_prompt_messages` returns it) has image parts."""
    return any(not isinstance(m["content"], str) for m in messages)


def encode_prompts(tokenizer, prompts: Sequence[list[dict]], *, thinking: bool, max_prompt_tokens: int,
                   images: Optional[ImageTokens] = None) -> tuple[list[torch.Tensor], list[Optional[PromptImages]]]:
    """(ids (L,) int64, images or None) of each prompt rendered with the generation prompt, its last
    `max_prompt_tokens` tokens; a prompt with image parts gets its image tokens and images (`images`: the
    image-text target's image processing; None refuses image prompts with a DataError)."""
    encoded, encoded_images = [], []
    for i, messages in enumerate(prompts):
        if has_image_parts(messages):
            if images is None:
                raise DataError(f"eval prompt {i + 1} has images and the target has no image processor: evaluate "
                                "image prompts with an image-text target (target.tokenizer names its processor), or "
                                "give text prompts")
            ids, prompt_images = encode_image_prompt(tokenizer, message_rows(messages, Path(".")), images,
                                                     thinking=thinking, max_prompt_tokens=max_prompt_tokens)
            encoded.append(ids)
            encoded_images.append(prompt_images)
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
        encoded.append(torch.tensor(ids, dtype=torch.int64))
        encoded_images.append(None)
    return encoded, encoded_images


def _histogram(results: Sequence[DecodeResult], block_size: int) -> list[int]:
    histogram = [0] * block_size
    for result in results:
        for length in result.acceptance_lengths:
            histogram[length - 1] += 1
    return histogram


def _tau(histogram: Sequence[int]) -> float:
    steps = sum(histogram)
    return sum(k * c for k, c in enumerate(histogram, 1)) / steps if steps else 0.0


def _per_prompt(results: Sequence[DecodeResult]) -> tuple[list[int], list[int]]:
    return [sum(r.acceptance_lengths) for r in results], [len(r.acceptance_lengths) for r in results]


def _weight_sample(target) -> list[float]:
    """A few values of the target's first and last plain floating-point weights: the same checkpoint gives the
    same values read from any folder, another checkpoint of the same architecture others."""
    plain = [p for p in target.parameters()
             if type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() and p.element_size() > 1]
    if not plain:
        return []
    # the first row's first values (an index, not a flatten: no copy of a large or strided weight)
    picks = [p.detach().reshape(1) if p.dim() == 0 else p.detach()[(0,) * (p.dim() - 1)][:16]
             for p in (plain[0], plain[-1])]
    return torch.cat([t.float() for t in picks]).cpu().tolist()  # host sync: once per evaluation, <= 32 values


def setting_digest(target, prompts: Sequence[torch.Tensor], images: Sequence[Optional[PromptImages]] = (),
                   **setting) -> str:
    """sha256 over what an evaluation ran on: the prompts' token ids in order, the decoding `setting` (new
    tokens, temperature, block size, stop tokens) and the target (its class, its parameters' names and shapes,
    the kinds of its weights, so an FP8 target differs from the same one in bf16, and a sample of their values;
    not the folder it was read from), and the prompts' images (their grids and patches)."""
    weights = sorted({f"{type(p).__name__}:{p.dtype}" for p in target.parameters()})
    shapes = [(name, tuple(p.shape)) for name, p in target.named_parameters()]
    digest = hashlib.sha256(repr((type(target).__name__, weights, shapes, _weight_sample(target),
                                  sorted(setting.items()))).encode())
    for p in prompts:
        digest.update(repr(p.tolist()).encode())
    for i in images:
        if i is not None:
            digest.update(repr(i.image_grid_thw.tolist()).encode())
            digest.update(i.pixel_values.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def evaluate_tau(
    target,
    make_proposer: Callable[[], BatchProposer],
    prompts: Sequence[torch.Tensor],
    *,
    block_size: int,
    tap_layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    seed: int = 0,
    with_baseline: bool = True,
    with_prompt_lookup: bool = True,
    batch_size: int = 64,
    pad_token_id: int = 0,
    progress: bool = False,
    images: Optional[Sequence[Optional[PromptImages]]] = None,
) -> EvalReport:
    """tau of the drafter `make_proposer()` builds (a fresh one per batch of `batch_size` prompts).

    Passes, each batched: the drafter; prompt lookup (`with_prompt_lookup`); plain target decoding
    (`with_baseline`), whose output the drafter's must equal at temperature 0. `images`: each prompt's images
    (None: text), for an image-text target."""
    start = time.perf_counter()
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    passes = 1 + with_prompt_lookup + with_baseline
    bar = _progress_bar(passes * len(prompts) * max_new_tokens) if progress else None

    def run(proposer_factory: Optional[Callable[[], BatchProposer]]) -> tuple[list[DecodeResult], float]:
        t0 = time.perf_counter()
        results: list[DecodeResult] = []
        for i in range(0, len(prompts), batch_size):
            chunk = [p.to(device) for p in prompts[i : i + batch_size]]
            results += decode_batch(
                target, chunk, proposer=proposer_factory() if proposer_factory else None,
                block_size=block_size if proposer_factory else 1, tap_layer_ids=tap_layer_ids,
                max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, temperature=temperature,
                generator=generator, pad_token_id=pad_token_id,
                images=images[i : i + batch_size] if images is not None else None,
                on_step=(lambda n: bar.update(n)) if bar is not None else (lambda n: None),
            )
            if bar is not None:  # rows that stopped early: their unused budget
                bar.update(len(chunk) * max_new_tokens - sum(len(r.output_ids) for r in results[i:]))
        return results, time.perf_counter() - t0

    spec, spec_s = run(make_proposer)
    lookup = run(PromptLookupProposer)[0] if with_prompt_lookup else None
    plain, plain_s = run(None) if with_baseline else (None, 0.0)
    if bar is not None:
        bar.close()
    histogram = _histogram(spec, block_size)
    lookup_histogram = _histogram(lookup, block_size) if lookup is not None else None
    tokens = sum(len(r.output_ids) for r in spec)
    committed, steps = _per_prompt(spec)
    lookup_committed, lookup_steps = _per_prompt(lookup) if lookup is not None else (None, None)
    return EvalReport(
        tau=_tau(histogram),
        acceptance_histogram=histogram,
        prompts=len(prompts),
        tokens_generated=tokens,
        steps=sum(histogram),
        block_size=block_size,
        temperature=temperature,
        target_tokens_per_s=sum(len(r.output_ids) for r in plain) / plain_s if plain and plain_s > 0 else None,
        speculative_tokens_per_s=tokens / spec_s if spec_s > 0 else 0.0,
        greedy_match_rate=_greedy_match_rate(spec, plain) if temperature <= 0 else None,
        prompt_lookup_tau=_tau(lookup_histogram) if lookup_histogram is not None else None,
        prompt_lookup_histogram=lookup_histogram,
        tau_stderr=tau_stderr(committed, steps),
        prompt_lookup_tau_stderr=tau_stderr(lookup_committed, lookup_steps) if lookup is not None else None,
        per_prompt_committed=committed,
        per_prompt_steps=steps,
        prompt_lookup_per_prompt_committed=lookup_committed,
        prompt_lookup_per_prompt_steps=lookup_steps,
        setting_digest=setting_digest(target, prompts, images or (), max_new_tokens=max_new_tokens, temperature=temperature,
                                      block_size=block_size, stop_token_ids=tuple(stop_token_ids)),
        seconds=time.perf_counter() - start,
    )


def _progress_bar(total_tokens: int):
    from tqdm.auto import tqdm

    return tqdm(total=total_tokens, desc="eval", unit="tok", dynamic_ncols=True)


def _greedy_match_rate(spec: list[DecodeResult], plain: Optional[list[DecodeResult]]) -> Optional[float]:
    """The share of prompts whose speculative output equals plain decoding's (None without plain decoding)."""
    if not plain or not spec:
        return None
    return sum(a.output_ids == b.output_ids for a, b in zip(spec, plain)) / len(spec)


def _with_error(stderr: Optional[float]) -> str:
    return plus_minus(stderr) + (" (standard error over prompts)" if stderr is not None else "")


def format_report(report: EvalReport) -> str:
    rows = [
        ("tau", f"{report.tau:.3f}" + _with_error(report.tau_stderr)),
        ("prompts", str(report.prompts)),
        ("verification steps", str(report.steps)),
        ("tokens generated", str(report.tokens_generated)),
        ("block size", str(report.block_size)),
        ("temperature", str(report.temperature)),
        ("speculative tokens/s", f"{report.speculative_tokens_per_s:.1f}"),
        ("target-only tokens/s", "-" if report.target_tokens_per_s is None else f"{report.target_tokens_per_s:.1f}"),
        ("greedy match rate", "-" if report.greedy_match_rate is None else f"{report.greedy_match_rate:.3f}"),
        ("prompt lookup tau", "-" if report.prompt_lookup_tau is None
         else f"{report.prompt_lookup_tau:.3f}" + _with_error(report.prompt_lookup_tau_stderr)),
        ("seconds", f"{report.seconds:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    hist = " ".join(f"{k + 1}:{c}" for k, c in enumerate(report.acceptance_histogram) if c)
    lines.append(f"{'acceptance histogram':<{width}}  {hist}")
    lines.append(f"note: {report.note}")
    if report.greedy_match_rate is not None and report.greedy_match_rate < 1:
        lines.append(f"note: {GREEDY_MISMATCH_NOTE}")
    return "\n".join(lines)
