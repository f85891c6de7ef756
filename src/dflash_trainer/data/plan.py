"""The epoch plan (the shared job list every rank reads), the held-out eval slice, and the plan summary.

Files under `RUN_DIR/plan/`:
- `epoch_E.json`: the jobs of epoch E (written atomically by rank 0; resume reads it back as is);
- `eval.jsonl`: held-out conversations, one `{"messages": [...], "source", "source_index"}` per line;
- `summary.json`: data and plan statistics.

Job ids are `epoch * JOB_ID_STRIDE + index in the epoch's job list`: unique across the run, stable on resume,
and the epoch can be read back from an id (`job_id // JOB_ID_STRIDE`).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_trainer.config import Config
from dflash_trainer.data.bucketing import assign_buckets, pack_first_fit_decreasing
from dflash_trainer.data.types import Conversation, Job
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.readback import damaged, parse_json, read_json_file, read_text_file
from dflash_trainer.rundir import RunDir, write_atomic

JOB_ID_STRIDE = 10**6
"""Most jobs one epoch may have; job id = epoch * JOB_ID_STRIDE + index."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketInfo:
    bucket_id: int
    min_length: int
    max_length: int
    num_sequences: int
    num_jobs: int
    """Jobs whose longest sequence is from this bucket; its shorter sequences also fill longer buckets' jobs, so a
    bucket of short sequences can lead none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochPlan:
    epoch: int
    seed: int
    token_budget: int
    """Tokens per packed batch (pipeline.token_budget)."""
    max_seqs: int
    """Most sequences per batch (`BatchShape.max_seqs`)."""
    buckets: tuple[BucketInfo, ...]
    """Length buckets (equal sequence counts). A job's bucket is the bucket of its first, longest sequence."""
    jobs: tuple[Job, ...]
    """In training order: buckets interleaved, shuffled from (seed, epoch)."""

    @property
    def num_tokens(self) -> int:
        return sum(j.num_tokens for j in self.jobs)

    @property
    def padding_waste(self) -> float:
        """1 - real tokens / (jobs * token_budget)."""
        return 1.0 - self.num_tokens / (len(self.jobs) * self.token_budget) if self.jobs else 0.0


def check_lengths_fit(max_length: int, token_budget: int) -> None:
    if max_length > token_budget:
        raise ConfigError(
            f"data.max_length ({max_length}) exceeds pipeline.token_budget ({token_budget}): a sequence must fit "
            "in one batch; lower data.max_length or raise pipeline.token_budget"
        )


def build_epoch_plan(lengths: Sequence[int], *, epoch: int, seed: int, num_buckets: int, token_budget: int,
                     max_seqs: int) -> EpochPlan:
    """Jobs of one epoch over sequences `0..len(lengths)-1`: bucket by length, pack each bucket, interleave."""
    too_long = [i for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        check_lengths_fit(max(lengths), token_budget)
    rng = random.Random(f"plan:{seed}:{epoch}")
    buckets = assign_buckets(lengths, num_buckets)
    bucket_of = {i: b for b, ids in enumerate(buckets) for i in ids}
    # One first-fit-decreasing pass over all sequences: a batch starts with the longest sequence left (its
    # bucket labels the job) and is filled with the longest that still fit, i.e. its own bucket first, then
    # the next shorter ones. Packing each bucket strictly apart would leave the tail of every long-bucket
    # batch empty.
    batches = pack_first_fit_decreasing(range(len(lengths)), lengths, token_budget=token_budget,
                                        max_seqs=max_seqs, rng=rng)
    packed = [(bucket_of[batch[0]], batch) for batch in batches]
    jobs_per_bucket = Counter(b for b, _ in packed)
    infos = [BucketInfo(bucket_id=b, min_length=min(lengths[i] for i in ids), max_length=max(lengths[i] for i in ids),
                        num_sequences=len(ids), num_jobs=jobs_per_bucket[b]) for b, ids in enumerate(buckets)]
    rng.shuffle(packed)  # interleave the buckets: every stretch of the plan mixes lengths
    if len(packed) >= JOB_ID_STRIDE:
        raise DataError(f"{len(packed)} jobs in one epoch exceed {JOB_ID_STRIDE}; raise pipeline.token_budget")
    jobs = tuple(
        Job(job_id=epoch * JOB_ID_STRIDE + k, epoch=epoch, bucket_id=b, sequence_ids=tuple(batch),
            num_tokens=sum(lengths[i] for i in batch))
        for k, (b, batch) in enumerate(packed)
    )
    return EpochPlan(epoch=epoch, seed=seed, token_budget=token_budget, max_seqs=max_seqs, buckets=tuple(infos),
                     jobs=jobs)


def plan_epoch(config: Config, lengths: Sequence[int], epoch: int) -> EpochPlan:
    """The epoch plan of a run's config (its seed, buckets and batch shape) over sequences of `lengths`."""
    return build_epoch_plan(lengths, epoch=epoch, seed=config.run.seed, num_buckets=config.data.num_buckets,
                            token_budget=config.batch.token_budget, max_seqs=config.batch.max_seqs)


def write_epoch_plan(run_dir: str | os.PathLike, plan: EpochPlan) -> Path:
    return write_atomic(RunDir(run_dir).epoch_plan(plan.epoch), json.dumps(asdict(plan), separators=(",", ":")))


PLAN_FIX = ("delete it and run again: `train` writes it anew from the config (drawn from run.seed: the same jobs "
            "for the same data and dflash-train version, so a resume still trains only what its checkpoint has not)")


def read_epoch_plan(run_dir: str | os.PathLike, epoch: int) -> EpochPlan:
    """The epoch's plan as written; a damaged file (not UTF-8, cut short, not a plan) is a DataError naming it."""
    path = RunDir(run_dir).epoch_plan(epoch)
    if not path.is_file():
        raise DataError(f"no epoch plan {path}; run `dflash-train plan` or start training to write it")
    d = read_json_file(path, what="epoch plan", fix=PLAN_FIX)
    try:
        return EpochPlan(
            epoch=d["epoch"], seed=d["seed"], token_budget=d["token_budget"], max_seqs=d["max_seqs"],
            buckets=tuple(BucketInfo(**b) for b in d["buckets"]),
            jobs=tuple(Job(job_id=j["job_id"], epoch=j["epoch"], bucket_id=j["bucket_id"],
                           sequence_ids=tuple(j["sequence_ids"]), num_tokens=j["num_tokens"]) for j in d["jobs"]),
        )
    except (KeyError, TypeError) as e:
        raise damaged(path, what="epoch plan", problem=f"not the plan we write: {type(e).__name__} {e}",
                      fix=PLAN_FIX) from None


# ---------------------------------------------------------------------------------------- eval slice


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldOut:
    train: list[Conversation]
    """What is left to train on, in the original order."""
    eval: list[Conversation]
    """The held-out conversations, one per held-out prompt, in the original order."""
    siblings_dropped: int
    """Other replies to a held-out prompt (`regenerate.num_samples`), left out of both: trained on, they would
    leak the held-out prompts."""


def prompt_key(conversation: Conversation) -> tuple:
    """What a conversation asks: its turns but the assistant's. Several sampled replies share it."""
    return tuple((m.role, m.content) for m in conversation.messages if m.role != "assistant")


def hold_out(conversations: Sequence[Conversation], num_eval: int, *, seed: int) -> HeldOut:
    """`num_eval` prompts drawn from `seed`; the first conversation of each is held out, and the others with the
    same prompt leave the training set too."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(conversations):
        groups.setdefault(prompt_key(c), []).append(i)
    members = list(groups.values())  # in order of first appearance
    chosen = random.Random(f"eval:{seed}").sample(range(len(members)), min(num_eval, len(members)))
    held = {members[g][0] for g in chosen}
    left_out = {i for g in chosen for i in members[g]}
    return HeldOut(train=[c for i, c in enumerate(conversations) if i not in left_out],
                   eval=[conversations[i] for i in sorted(held)], siblings_dropped=len(left_out) - len(held))


def write_eval_conversations(run_dir: str | os.PathLike, conversations: Sequence[Conversation]) -> Path:
    text = "".join(json.dumps(c.to_json()) + "\n" for c in conversations)
    return write_atomic(RunDir(run_dir).eval_conversations, text)


EVAL_FIX = "delete it: the next `train` or `plan` writes it again from the tokenized cache"


def read_eval_conversations(run_dir: str | os.PathLike) -> list[Conversation]:
    """The held-out conversations as written; a damaged line is a DataError naming the file and line."""
    path = RunDir(run_dir).eval_conversations
    text = read_text_file(path, what="held-out conversations", fix=EVAL_FIX)
    held = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        row = parse_json(line, path, what="held-out conversations", fix=EVAL_FIX, line=lineno)
        try:
            held.append(Conversation.from_json(row))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise damaged(f"{path}:{lineno}", what="held-out conversations", fix=EVAL_FIX,
                          problem=f"not a conversation we write: {type(e).__name__} {e}") from None
    return held


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    return write_atomic(RunDir(run_dir).plan_summary, json.dumps(summary, indent=2, sort_keys=True) + "\n")
