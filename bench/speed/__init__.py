"""Training throughput on one GPU: our step against a naive baseline, the drafter step alone, real runs."""
