"""Where a hub id's files come from when the Hugging Face hub cannot be reached.

transformers retries an unreachable hub for most of a minute before it gives up, even for a model in the local
cache. So a hub id is checked once per process: the hub's host is tried with a short connect timeout; when it does not answer,
a model in the cache is read from its cached folder (no network), and one that is not is a one-line error naming
the setting, the hub and the fix. With `HF_HUB_OFFLINE=1` nothing is probed (the library reads the cache alone), nor
behind a proxy (a direct connection says nothing of it). The name lookup (the system resolver, which may wait
long for a DNS server that does not answer) runs in a thread and is given the same bound.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from dflash_trainer.errors import ConfigError

CONNECT_TIMEOUT_S = 3.0


def _lookup(host: str, port: int) -> tuple[str, int] | str:
    """The first address of `host` (a TCP endpoint), or why there is none; a lookup still running after
    CONNECT_TIMEOUT_S is abandoned to its daemon thread."""
    found: list = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][:2])
        except OSError as e:
            found.append(f"{type(e).__name__}: {e.strerror or e}")

    thread = threading.Thread(target=resolve, name="hub-lookup", daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT_S)
    return found[0] if found else f"no name lookup of {host} within {CONNECT_TIMEOUT_S:g} s"


@functools.lru_cache(maxsize=None)
def hub_unreachable(endpoint: str) -> Optional[str]:
    """Why the hub at `endpoint` cannot be reached (None when a TCP connection to it opens)."""
    url = urlparse(endpoint)
    host, port = url.hostname or endpoint, url.port or (80 if url.scheme == "http" else 443)
    address = _lookup(host, port)
    if isinstance(address, str):
        return address
    try:
        with socket.create_connection(address, timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}" if not isinstance(e, TimeoutError) else \
            f"no answer within {CONNECT_TIMEOUT_S:g} s"


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
"""Set: the hub is reached through a proxy, which a direct connection cannot test (nothing is probed)."""


def _cached_weights(folder: Path) -> bool:
    """Whether a cached snapshot holds the model's weights: model.safetensors, or an index and all its shards."""
    if (folder / "model.safetensors").is_file():
        return True
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    return all((folder / shard).is_file() for shard in shards)


def hub_reference(name: str, key: str, needs: str, *, weights: bool = False) -> str:
    """`name` (a hub id) as the loaders should get it: as it is when the hub answers, the library is offline, or
    a proxy is set; the cached snapshot folder when the hub does not answer and `needs` (and with `weights`, the
    weights) is cached; else a ConfigError naming `key`."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in PROXY_VARIABLES):
        return name
    why = hub_unreachable(constants.ENDPOINT)
    if why is None:
        return name
    cached = try_to_load_from_cache(name, needs)
    if isinstance(cached, str) and (not weights or _cached_weights(Path(cached).parent)):
        return str(Path(cached).parent)
    what = "the model's weights are" if weights else "the model is"
    raise ConfigError(
        f"{key}={name!r} is not a local folder, the hub ({constants.ENDPOINT}) cannot be reached from here ({why}), "
        f"and {what} not in the local cache ({constants.HF_HUB_CACHE}): "
        "download it where there is network "
        f"(`hf download {name}`) and set {key} to its folder, or copy the cache here")
