"""The served engines for bench/serving/serving_tau.py: the server commands (docs/serving.md's), starting and
stopping a server, greedy requests, and each engine's mean acceptance length from its own counters.

Acceptance length here is ours (eval/evaluate.py's TAU_NOTE): tokens committed per target verification step, the
bonus token included, the prefill's token not a step. Read from the engines' sources (vLLM 0.33.0, SGLang 0.5.23),
not run on a GPU yet:
- vLLM counts drafts (one per verification step) and accepted draft tokens (`vllm:spec_decode_num_drafts_total`,
  `vllm:spec_decode_num_accepted_tokens_total` on /metrics; v1/spec_decode/metrics.py), and logs
  `1 + accepted / drafts` as its mean acceptance length: ours;
- SGLang returns per request `meta_info.spec_verify_ct` (verification steps) and `completion_tokens` (every output
  token, the prefill's first one included); its own `spec_accept_length` is their ratio, so ours is
  `(completion_tokens - 1) / spec_verify_ct` summed over the requests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional


def server_command(engine: str, fmt: str, *, python: str, target: str, export: str, block_size: int, port: int,
                   dtype: str, max_model_len: int) -> list[str]:
    """The serving command of docs/serving.md for this engine and format, on `port`."""
    if engine == "vllm":
        # `vllm serve`; the speculators format also through --speculative-config: `vllm serve EXPORT` (0.33) takes
        # only a hub id as the verifier, and a local practice target has none
        speculative = {"method": "dflash", "model": export, "num_speculative_tokens": block_size - 1}
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", target, "--speculative-config",
                json.dumps(speculative), "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
                "--gpu-memory-utilization", "0.6"]
    if engine == "sglang" and fmt == "dflash":
        return [python, "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "DFLASH",
                "--speculative-draft-model-path", export, "--port", str(port), "--dtype", dtype,
                "--context-length", str(max_model_len), "--mem-fraction-static", "0.6"]
    raise ValueError(f"{engine} does not serve the {fmt} format (SGLang reads the dflash format only)")


class Server:
    """A server process, its log in `log`; `stop()` ends it (and its children)."""

    def __init__(self, command: list[str], log: Path, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self._proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self._proc.returncode} (see {self._log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise TimeoutError(f"the server did not answer /health within {timeout_s:.0f} s (see {self._log.name})")

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)  # its own session: the engine's worker processes too
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._log.close()


def _post(url: str, body: dict, timeout_s: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


def metric_sum(text: str, name: str) -> float:
    """The sum over label sets of a Prometheus counter `name` in /metrics text (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def vllm_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return (metric_sum(text, "vllm:spec_decode_num_drafts_total"),
            metric_sum(text, "vllm:spec_decode_num_accepted_tokens_total"))


def run_vllm(url: str, target: str, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int],
             concurrency: int) -> dict:
    """Greedy completions of token-id prompts; acceptance length from the counters' change over the run."""
    drafts0, accepted0 = vllm_counters(url)
    body = lambda ids: {"model": target, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0,
                        "stop_token_ids": stop_ids, "skip_special_tokens": False}
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda ids: _post(url + "/v1/completions", body(ids)), prompts))
    drafts1, accepted1 = vllm_counters(url)
    drafts, accepted = drafts1 - drafts0, accepted1 - accepted0
    return {"tau": 1 + accepted / drafts if drafts else None, "steps": drafts, "accepted_draft_tokens": accepted,
            "tokens": sum(r["usage"]["completion_tokens"] for r in replies)}


def run_sglang(url: str, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int],
               concurrency: int) -> dict:
    """Greedy generations of token-id prompts; acceptance length from each reply's verification count."""
    body = lambda ids: {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                              "stop_token_ids": stop_ids}}
    with ThreadPoolExecutor(concurrency) as pool:
        infos = [r["meta_info"] for r in pool.map(lambda ids: _post(url + "/generate", body(ids)), prompts)]
    return sglang_tau(infos)


def sglang_tau(infos: list[dict]) -> dict:
    """Our acceptance length from SGLang replies' meta_info (module docstring), and SGLang's own figure."""
    steps = sum(i.get("spec_verify_ct", 0) for i in infos)
    tokens = sum(i["completion_tokens"] for i in infos)
    return {"tau": (tokens - len(infos)) / steps if steps else None, "steps": steps, "tokens": tokens,
            "engine_accept_length": tokens / steps if steps else None}


def measure(engine: str, command: list[str], *, port: int, log: Path, target: str, prompts: list[list[int]],
            max_new_tokens: int, stop_ids: list[int], concurrency: int, ready_timeout_s: float) -> dict:
    """Start the server (`command`, listening on `port`), send the prompts, stop it; the acceptance figures, or
    the error."""
    server = Server(command, log, port)
    try:
        server.wait_ready(ready_timeout_s)
        t0 = time.monotonic()
        if engine == "vllm":
            result = run_vllm(server.url, target, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                              concurrency=concurrency)
        else:
            result = run_sglang(server.url, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                concurrency=concurrency)
        return result | {"seconds": round(time.monotonic() - t0, 1)}
    except Exception as e:  # a row of the table: the engine that failed, and why
        return {"tau": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def optional_float(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)
