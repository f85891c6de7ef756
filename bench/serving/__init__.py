"""Acceptance length of a drafter served by vLLM and SGLang against dflash-train eval."""
