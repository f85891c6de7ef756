"""The commands that serve a drafter just exported, printed at the end of `dflash-train export`: the exact paths, the
number of speculative tokens its block drafts, and the method each engine names it by.

Facts from the engines (../shared/SERVING_NOTES.md): vLLM takes the block as `1 + num_speculative_tokens` and the
method `dflash` (DFlash, DFlash2, LiLiCorr: its class follows `architectures`) or `dspark`; it loads the drafter in
the target's dtype. SGLang reads the block size from the export's config and the dflash format only. A speculators
export names its verifier: `vllm serve EXPORT` serves it when that is a hub id (vLLM 0.33 refuses a local folder
there), else the target folder is served with the export as its speculative model.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

SGLANG_ALGORITHM = {"dspark": "DSPARK"}
"""SGLang's --speculative-algorithm per variant (DFLASH otherwise)."""


def serve_lines(*, variant: str, draft_length: int, export_dir: Path, fmt: str, target: Optional[str],
                verifier: Optional[str] = None, verifier_is_hub: bool = False, dtype: Optional[str] = None) -> list[str]:
    """What `export` prints after writing `export_dir`: `target` the model to serve it with (a hub id or folder;
    None: the config's target has no folder, a random one), `verifier` what a speculators export records."""
    method = "dspark" if variant == "dspark" else "dflash"
    spec = json.dumps({"method": method, "model": str(export_dir), "num_speculative_tokens": draft_length})
    lines = [f"serve it ({draft_length} speculative tokens a step; the engines load the drafter in the target's dtype"
             f"{f', the export holds {dtype}' if dtype else ''}; on a GPU: pip install vllm>=0.33 or sglang>=0.5.23):"]
    if fmt == "speculators":
        if verifier_is_hub:
            lines.append(f"  vllm serve {shlex.quote(str(export_dir))}")
        lines.append(f"  vllm serve {shlex.quote(str(verifier))} --speculative-config {shlex.quote(spec)}")
        return lines
    if target is None:
        return lines + ["  (this config's target is random weights with no folder: export again with --save-target DIR "
                        "to write it, and serve DIR)"]
    lines.append(f"  vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}")
    # SGLang reads the block from the export, but for DSpark it verifies the drafts and the anchor: one more
    width = f" --speculative-num-draft-tokens {draft_length + 1}" if variant == "dspark" else ""
    lines.append(f"  python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm "
                 f"{SGLANG_ALGORITHM.get(variant, 'DFLASH')} --speculative-draft-model-path "
                 f"{shlex.quote(str(export_dir))}{width}")
    return lines


def export_dtype(export_dir: Path) -> Optional[str]:
    """The dtype an export's config.json records, if any."""
    try:
        config = json.loads((export_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    layers = config.get("transformer_layer_config") if isinstance(config.get("transformer_layer_config"), dict) else {}
    found = config.get("dtype") or config.get("torch_dtype") or layers.get("dtype")
    return str(found) if found else None
