"""Shared fixtures: a tiny tokenizer with a chat template and a tiny Qwen3 target, built locally."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _reset_torch_state():
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default_dtype)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from dflash_trainer.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer("qwen3")


@pytest.fixture(scope="session")
def tiny_target_config():
    from dflash_trainer.target.presets import preset_config

    return preset_config("tiny")


@pytest.fixture()
def tiny_target(tiny_target_config):
    """A random-weight tiny Qwen3 causal LM in fp32, eval mode, frozen."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(tiny_target_config).eval()
    model.requires_grad_(False)
    return model
