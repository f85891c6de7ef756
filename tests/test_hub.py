"""A hub id with no reachable hub: one clear line within seconds (transformers retries for most of a minute), or
the model's cached folder when the cache has it; a speculators export's verifier falls back at once."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from huggingface_hub import constants

from dflash_trainer import hub
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import target_model_config


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """A hub endpoint that refuses connections, an empty cache, and the library not in offline mode."""
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    hub.hub_unreachable.cache_clear()
    yield tmp_path / "hub-cache"
    hub.hub_unreachable.cache_clear()


def test_a_hub_id_that_cannot_be_fetched_fails_at_once_naming_the_setting(no_hub):
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        target_model_config(TargetConfig(path="dflash-test/no-such-model"))
    assert time.monotonic() - start < 10
    message = str(e.value)
    assert message.startswith("target.path='dflash-test/no-such-model' is not a local folder, the hub "
                              "(http://127.0.0.1:9) cannot be reached from here"), message
    assert "hf download dflash-test/no-such-model" in message and "\n" not in message


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(no_hub):
    from transformers import Qwen3Config

    snapshot = no_hub / "models--dflash-test--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=128, vocab_size=256).save_pretrained(snapshot)
    (no_hub / "models--dflash-test--cached" / "refs").mkdir()
    (no_hub / "models--dflash-test--cached" / "refs" / "main").write_text("abc123")
    start = time.monotonic()
    config = target_model_config(TargetConfig(path="dflash-test/cached"))
    assert config.hidden_size == 64 and time.monotonic() - start < 10


def test_weights_must_be_cached_too_and_a_proxy_is_not_probed(no_hub, monkeypatch):
    """A snapshot with config.json alone serves the config, not the model's load; behind a proxy nothing is probed
    (a direct connection cannot tell), the name goes to the library as it is."""
    snapshot = no_hub / "models--dflash-test--partial" / "snapshots" / "r1"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (no_hub / "models--dflash-test--partial" / "refs").mkdir()
    (no_hub / "models--dflash-test--partial" / "refs" / "main").write_text("r1")
    assert hub.hub_reference("dflash-test/partial", "target.path", "config.json") == str(snapshot)
    with pytest.raises(ConfigError, match="the model's weights are not in the local cache"):
        hub.hub_reference("dflash-test/partial", "target.path", "config.json", weights=True)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(ConfigError, match="weights are not in the local cache"):  # a shard missing
        hub.hub_reference("dflash-test/partial", "target.path", "config.json", weights=True)
    (snapshot / "s1.safetensors").write_bytes(b"")
    assert hub.hub_reference("dflash-test/partial", "target.path", "config.json", weights=True) == str(snapshot)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub.hub_reference("dflash-test/no-such-model", "target.path", "config.json") == "dflash-test/no-such-model"


def test_a_speculators_verifier_the_hub_cannot_serve_falls_back_at_once(no_hub, caplog):
    from transformers import Qwen3Config

    from dflash_trainer.drafter.export_speculators import _verifier_config

    target = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=256)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        config = _verifier_config("dflash-test/verifier", target, is_target=False)
    assert config["hidden_size"] == 64 and time.monotonic() - start < 10
    assert "the hub (http://127.0.0.1:9) cannot be reached from here" in caplog.text
    with pytest.raises(ConfigError, match="cannot be reached"):
        _verifier_config("dflash-test/verifier", None, is_target=False)
    assert json.dumps(config)  # a plain dict, as the export writes it


def test_a_name_lookup_that_hangs_is_bounded(monkeypatch):
    """A DNS server that does not answer: the probe gives up after its timeout, naming the lookup. The lookup's
    thread is released and joined before the test ends (no thread of this test outlives it)."""
    release = threading.Event()

    def hanging_lookup(*args, **kwargs):
        release.wait(30)
        raise socket.gaierror("the test released the lookup")

    monkeypatch.setattr(hub.socket, "getaddrinfo", hanging_lookup)
    monkeypatch.setattr(hub, "CONNECT_TIMEOUT_S", 0.3)
    hub.hub_unreachable.cache_clear()
    start = time.monotonic()
    try:
        reason = hub.hub_unreachable("https://hub.example.invalid")
        elapsed = time.monotonic() - start
    finally:
        hub.hub_unreachable.cache_clear()
        release.set()
        for thread in threading.enumerate():
            if thread.name == "hub-lookup":
                thread.join(10)
    assert elapsed < 2
    assert reason == "no name lookup of hub.example.invalid within 0.3 s"
    assert not [t for t in threading.enumerate() if t.name == "hub-lookup"]
