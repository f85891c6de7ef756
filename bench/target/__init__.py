"""The target forward: early exit, tap capture, padded batches, shapes seen for the first time."""
