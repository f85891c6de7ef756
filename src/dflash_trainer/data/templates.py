"""Builtin chat templates: Qwen3-style, Qwen3-VL-style with image parts, Llama-3-style, ChatML, and each target
family's own format (written from the family's published template: turns, generation prompt, thinking tags; no tool
calls), which the family's tiny tokenizer (`tiny:<family>`) carries."""

from __future__ import annotations

from importlib import resources

FAMILY_TEMPLATES = ("gemma3", "gemma4", "llama4", "deepseek-v3", "glm4-moe", "minimax-m2", "nemotron-h", "qwen3.5",
                    "kimi-k2")
"""The target families whose own chat format differs from the generic ones (`tiny:<family>` tokenizers carry them)."""
TEMPLATE_NAMES = ("qwen3", "qwen3-vl", "llama3", "chatml", *FAMILY_TEMPLATES)


def builtin_template(name: str) -> str:
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown builtin chat template {name!r}; choose one of {TEMPLATE_NAMES}")
    return resources.files("dflash_trainer").joinpath("templates", f"{name}.jinja").read_text()
