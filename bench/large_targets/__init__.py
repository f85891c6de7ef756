"""Targets past the 8B bf16 shape: FP8, the 70B shape, MoE and gpt-oss, a TP=2 target group."""
