"""`export` ends with the command that serves the drafter it just wrote: the paths it wrote, the number of speculative
tokens its block drafts, the engine's method; the demo's random target can be written beside either format."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from dflash_trainer.cli import main
from dflash_trainer.commands.serve_command import serve_lines
from tests.test_export_safety import _checkpoint


def _speculative_config(line: str) -> dict:
    words = shlex.split(line)
    return json.loads(words[words.index("--speculative-config") + 1])


def test_the_lines_name_the_paths_tokens_and_method():
    out = Path("/runs/q8b/export")
    lines = serve_lines(variant="dflash2", draft_length=15, export_dir=out, fmt="dflash", target="Qwen/Qwen3-8B",
                        dtype="float32")
    vllm, sglang = lines[1], lines[2]
    assert shlex.split(vllm)[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    assert _speculative_config(vllm) == {"method": "dflash", "model": str(out), "num_speculative_tokens": 15}
    words = shlex.split(sglang)
    assert words[words.index("--model-path") + 1] == "Qwen/Qwen3-8B" and "DFLASH" in words
    assert words[words.index("--speculative-draft-model-path") + 1] == str(out)
    assert "the export holds float32" in lines[0] and "target's dtype" in lines[0]
    dspark = serve_lines(variant="dspark", draft_length=7, export_dir=out, fmt="dflash", target="/m")
    assert _speculative_config(dspark[1]) == {"method": "dspark", "model": str(out), "num_speculative_tokens": 7}
    assert "DSPARK" in dspark[2] and shlex.split(dspark[2])[-2:] == ["--speculative-num-draft-tokens", "8"]
    hub = serve_lines(variant="dflash", draft_length=7, export_dir=out, fmt="speculators", target=None,
                      verifier="Qwen/Qwen3-8B", verifier_is_hub=True)
    assert hub[1] == f"  vllm serve {out}" and _speculative_config(hub[2])["num_speculative_tokens"] == 7
    local = serve_lines(variant="dflash", draft_length=7, export_dir=out, fmt="speculators", target=None,
                        verifier="/data/target", verifier_is_hub=False)
    assert len(local) == 2 and shlex.split(local[1])[2] == "/data/target"
    random = serve_lines(variant="dflash", draft_length=7, export_dir=out, fmt="dflash", target=None)
    assert "--save-target DIR" in random[1]


def test_the_demo_export_prints_a_command_that_serves_it_in_either_format(tmp_path, capsys):
    """The demo's block of 8 drafts 7 tokens; its random target is written by --save-target for the dflash format
    too, and the printed commands name the folders written."""
    ckpt, args, _ = _checkpoint(tmp_path / "run")
    for fmt in ("dflash", "speculators"):
        out, target = tmp_path / f"export-{fmt}", tmp_path / f"target-{fmt}"
        assert main([*args, "--out", str(out), "--format", fmt, "--save-target", str(target)]) == 0
        printed = capsys.readouterr().out.splitlines()
        served = [line for line in printed if line.startswith("  vllm serve")]
        assert served, printed
        config = _speculative_config(served[-1])
        assert config == {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": 7}
        assert shlex.split(served[-1])[2] == str(target.resolve())
        assert (target / "config.json").is_file() and (out / "model.safetensors").is_file()
        if fmt == "dflash":
            sglang = [line for line in printed if "sglang.launch_server" in line]
            assert sglang and str(target.resolve()) in sglang[0]
