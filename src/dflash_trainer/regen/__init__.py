"""`dflash-train regenerate`: answer a dataset's prompts again with the target (the DFlash data recipe).

Public surface: `regenerate` (runner), `LocalBackend` / `OpenAIBackend` (imported from their modules so
the HTTP path never loads torch models), `read_rows`, `check_regen_settings`, `RegenSettings`.
"""

from dflash_trainer.data.shard_files import read_rows
from dflash_trainer.regen.runner import RegenSummary, regenerate
from dflash_trainer.regen.settings import RegenSettings, check_regen_settings, read_manifest, settings_from_config

__all__ = [
    "RegenSettings",
    "RegenSummary",
    "check_regen_settings",
    "read_manifest",
    "read_rows",
    "regenerate",
    "settings_from_config",
]
