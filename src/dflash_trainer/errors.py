"""Errors a user can act on: each message names the input and the fix."""


class ConfigError(ValueError):
    """A configuration key has a wrong type, an impossible value or is unknown."""


class DataError(ValueError):
    """Input data cannot be used as given (missing file, wrong format, nothing trainable)."""


class StorageError(OSError):
    """The run's disk cannot take a file (full, or over the file-size limit); the message names the disk, the space
    needed and the fix."""


class NotBuiltYet(RuntimeError):
    """A subcommand or option exists in the interface but is not implemented yet."""
