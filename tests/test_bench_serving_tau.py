"""bench/serving/serving_engines.py on the CPU (the servers need a GPU): the acceptance length it reads from a fake vLLM's
/metrics counters and a fake SGLang's replies, and the serving commands it starts (docs/serving.md's)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the `bench` package

from bench.serving.serving_engines import metric_sum, run_sglang, run_vllm, server_command  # noqa: E402

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="T"} %d
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="T"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="T",position="0"} 99
"""


class _Fake(BaseHTTPRequestHandler):
    """A fake server: each request is 3 verification steps committing 7 tokens after the prefill's one."""

    drafts = accepted = 0

    def _reply(self, body: str) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        self._reply(METRICS % (_Fake.drafts, _Fake.accepted) if self.path == "/metrics" else "ok")

    def do_POST(self):
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Fake.drafts, _Fake.accepted = _Fake.drafts + 3, _Fake.accepted + 4  # 3 steps x 1 bonus + 4 accepted = 7
        if self.path == "/generate":
            self._reply(json.dumps({"meta_info": {"completion_tokens": 8, "spec_verify_ct": 3}}))
        else:
            self._reply(json.dumps({"usage": {"completion_tokens": 8}}))

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Fake.drafts, _Fake.accepted = 5, 2  # before the run: the warm-up's, left out
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_metric_sum():
    assert metric_sum(METRICS % (12, 30), "vllm:spec_decode_num_drafts_total") == 12
    assert metric_sum(METRICS % (12, 30), "vllm:spec_decode_num_accepted_tokens_total") == 30
    assert metric_sum("", "vllm:spec_decode_num_drafts_total") == 0


def test_acceptance_length_is_ours(fake_url):
    prompts = [[1, 2, 3], [4, 5]]
    vllm = run_vllm(fake_url, "T", prompts, max_new_tokens=8, stop_ids=[2], concurrency=2)
    assert vllm["steps"] == 6 and vllm["tau"] == pytest.approx(7 / 3)
    sglang = run_sglang(fake_url, prompts, max_new_tokens=8, stop_ids=[2], concurrency=2)
    assert sglang["tau"] == pytest.approx(7 / 3) and sglang["engine_accept_length"] == pytest.approx(8 / 3)


def test_server_commands_are_the_readmes():
    common = dict(python="py", target="T", export="E", block_size=16, port=1, dtype="bfloat16", max_model_len=64)
    vllm = server_command("vllm", "dflash", **common)
    assert vllm[2:6] == ["vllm.entrypoints.cli.main", "serve", "T", "--speculative-config"]
    assert json.loads(vllm[6]) == {"method": "dflash", "model": "E", "num_speculative_tokens": 15}
    sglang = server_command("sglang", "dflash", **common)
    assert sglang[2:9] == ["sglang.launch_server", "--model-path", "T", "--speculative-algorithm", "DFLASH",
                           "--speculative-draft-model-path", "E"]
    with pytest.raises(ValueError, match="dflash format only"):
        server_command("sglang", "speculators", **common)


def test_serving_tau_dry_run_renders_the_prompts_as_eval_does(tmp_path, capsys, tiny_tokenizer):
    """`bench/serving/serving_tau.py --dry-run` renders and counts the prompts as `dflash-train eval` does and prints
    each engine's command (no engine, no GPU)."""
    from bench.serving import serving_tau
    from dflash_trainer.drafter.export import export_drafter
    from tests.drafter_helpers import tiny_drafter
    from tests.eval_helpers import tiny_target_model

    target = tmp_path / "target"
    tiny_target_model().save_pretrained(target)
    tiny_tokenizer.save_pretrained(target)
    drafter, target_config = tiny_drafter()
    export = export_drafter(drafter, tmp_path / "export", target_config=target_config)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                               for text in ("hello there", "the sea is wide")))
    assert serving_tau.main(["--config", "demo", "--drafter", str(export), "--prompts", str(prompts), "--dry-run",
                             f"target.path={target}", "target.random_init=null", f"target.tokenizer={target}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("2 prompts (") and "vllm dflash: " in printed and "sglang dflash: " in printed
