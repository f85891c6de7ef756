"""Builtin chat templates (Qwen3-style, Qwen3-VL-style with image parts, Llama-3-style, ChatML)."""

from __future__ import annotations

from importlib import resources

TEMPLATE_NAMES = ("qwen3", "qwen3-vl", "llama3", "chatml")


def builtin_template(name: str) -> str:
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown builtin chat template {name!r}; choose one of {TEMPLATE_NAMES}")
    return resources.files("dflash_trainer").joinpath("templates", f"{name}.jinja").read_text()
