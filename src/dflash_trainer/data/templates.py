"""Builtin chat templates (Qwen3-style, Llama-3-style, ChatML) and their end-of-turn markers."""

from __future__ import annotations

from importlib import resources

TEMPLATE_NAMES = ("qwen3", "llama3", "chatml")


def builtin_template(name: str) -> str:
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown builtin chat template {name!r}; choose one of {TEMPLATE_NAMES}")
    return resources.files("dflash_trainer").joinpath("templates", f"{name}.jinja").read_text()
