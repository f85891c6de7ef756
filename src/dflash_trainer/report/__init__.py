"""The run report (`dflash-train report RUN_DIR`): figures of a run's metrics and summary, in one HTML page."""
