"""Several GPUs of one host: target:drafter splits, colocated ranks, context-parallel groups."""
