"""The image-text case: a DFlash drafter of a tiny Qwen3-VL target drafting the reply to a conversation with an image.

The text cases feed random taps; this one feeds what the drafter meets when it serves an image-text target:
- taps: our capture (training's `TapCapture`, the image-text forward with its vision tower, deepstack features and
  M-RoPE positions) of a conversation whose user turn holds an image, tokenized by our data code. vLLM runs its own
  Qwen3-VL target on the same ids and patches (engine_vllm.py) and its aux hidden states must equal them at every
  position, the image's included;
- positions: the engines hand the drafter sequence positions, not the target's M-RoPE ones. After a prompt of C tokens
  the context is at 0..C-1 and the block [first reply token, MASK x (B-1)] at C..C+B-1: vLLM's V2 runner writes them
  from `input_batch.positions` (`v1/worker/gpu/spec_decode/dflash/speculator.py`, `_prepare_dflash_inputs_kernel`;
  the target's M-RoPE positions go to the target alone, `model_states/default.py`), SGLang from the prefix lengths
  (`dflash_worker_v2.py`: `compute_position`, `prefix_lens + arange`);
- reference: our training forward (`forward_train`) of the block anchored at the first reply token, context strictly
  before it: the engines must compute what the drafter was trained to compute there.

SGLang 0.5.23 cannot serve this drafter: its model runner asks the target to capture the tapped layers
(`model_runner_components/attention_backend_setup.py`), and `Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture`
calls `set_dflash_layers_to_capture` on its language model, `Qwen3LLMModel`, which has none (AttributeError). Its row
expects that refusal (report.py), and fails once SGLang serves the case and computes another forward.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration

from dflash_trainer.data.masks import end_of_turn_marker
from dflash_trainer.data.sources import normalize_row
from dflash_trainer.data.tiny_tokenizer import build_tiny_image_tokens, build_tiny_tokenizer
from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_one
from dflash_trainer.data.tokenized import TokenizedDataset
from dflash_trainer.data.types import TokenizedSequence
from dflash_trainer.drafter.anchors import plan_from_anchors
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import MROPE_KEYS, drafter_spec
from dflash_trainer.target.capture import TapCapture, prepare_inputs
from dflash_trainer.target.presets import preset_config
from dflash_trainer.transport.wire import WireSpec, allocate
from serving_check.cases import BLOCK_SIZE, Reference, Target, randomize, read_target, reference_of
from serving_check.jobs import FORMATS, Job
from serving_check.variants import DFLASH

DRAFTER = "qwen3-vl-image"
"""The job's drafter name (the table's drafter column)."""
TAPS = (0, 2, 4)
"""Tap 0 is on the layer after which Qwen3-VL adds its deepstack features (the tiny preset's only one)."""
IMAGE_SIZE = (96, 128)
"""(height, width) pixels: a 6 x 8 patch grid, 12 image tokens, whose M-RoPE positions span 3 x 4, so the text after
the image sits 8 positions below its sequence position."""


def make_vl_target(folder: Path, seed: int = 5) -> tuple[Target, Qwen3VLForConditionalGeneration]:
    """The tiny Qwen3-VL preset with random weights, saved to `folder`; returns it and the model (fp32, eval)."""
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(preset_config("tiny-qwen3-vl")).eval()
    model.save_pretrained(folder)
    return read_target(folder), model


def conversation(seed: int = 7) -> TokenizedSequence:
    """A conversation whose user turn has an image between two texts, tokenized as training tokenizes it and read as
    training reads it (its pixels made from the image's reference)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look at this:"},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "what is in it?"}]},
        {"role": "assistant", "content": "Coloured noise: random pixels, with no shape or object in them at all."}]}
    tokenizer = build_tiny_tokenizer("qwen3-vl")
    images = build_tiny_image_tokens("qwen3-vl")
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tokenizer, thinking=False),
                                max_length=512, min_supervised=4, images=images)
    chat = normalize_row(row, source="serving-check", index=0, purpose=None, image_dir=Path("."))
    sequence = tokenize_one(chat, tokenizer, settings)
    if isinstance(sequence, str):
        raise RuntimeError(f"the check's image conversation was dropped ({sequence})")
    return TokenizedDataset.from_sequences([(chat, sequence)], images)[0]


@torch.no_grad()
def capture_taps(model, sequence: TokenizedSequence) -> torch.Tensor:
    """(S, K*H) training's taps of `sequence` (its image-text forward)."""
    hidden = model.config.text_config.hidden_size
    out = allocate(WireSpec(token_budget=sequence.num_tokens, max_seqs=1, num_taps=len(TAPS), hidden=hidden,
                            dtype=torch.float32, has_last_hidden=False), "cpu")
    TapCapture(model, TAPS).run(prepare_inputs([sequence], out), out)
    return out.taps[: sequence.num_tokens].clone()


def build_image_jobs(work: Path, formats=FORMATS, *, old_mrope_fields: bool = False
                     ) -> tuple[list[Job], dict[str, Reference], Target]:
    """The drafter of the image case exported in each format, its engine inputs, and our training forward.
    `old_mrope_fields`: each export declares the target's M-RoPE fields, as our exports did before the drafter's
    RoPE was written 1-D (`DrafterSpec.rope_parameters`)."""
    target, model = make_vl_target(work / "vl-target")
    sequence = conversation()
    taps = capture_taps(model, sequence)  # (S, K*H)
    config = model.config
    spec = drafter_spec(config, DrafterConfig(num_layers=3, block_size=BLOCK_SIZE, tap_layer_ids=list(TAPS)),
                        mask_token_id=config.text_config.vocab_size - 1)
    drafter = DFlashDrafter(spec, attention="sdpa")
    randomize(drafter, seed=30)
    ids, mask = sequence.input_ids, sequence.loss_mask
    anchor = int(torch.nonzero(mask[:-1] & mask[1:])[0])  # the first reply token: what serving drafts after
    image = torch.nonzero(ids == config.image_token_id).flatten()
    if not len(image) or int(image[-1]) >= anchor:
        raise RuntimeError("the check's image conversation must hold its image before the reply")
    cu_seqlens = torch.tensor([0, sequence.num_tokens], dtype=torch.int32)
    plan = plan_from_anchors(anchors=torch.tensor([anchor]), block_valid=torch.tensor([True]), input_ids=ids,
                             loss_mask=mask, cu_seqlens=cu_seqlens, block_size=BLOCK_SIZE,
                             mask_token_id=spec.mask_token_id)
    with torch.no_grad():
        hidden = drafter.forward_train(taps=taps, cu_seqlens=cu_seqlens, plan=plan,
                                       embed_weight=target.embed)[0]  # (B, H)
    inputs = {  # what the engines draft from after the prompt (the module docstring)
        "taps": taps[:anchor],  # (C, K*H): the prompt's taps, the image's included
        "block_ids": plan.block_ids[0],  # (B,)
        "context_positions": torch.arange(anchor),
        "block_positions": anchor + torch.arange(BLOCK_SIZE),
    }
    torch.save(inputs, work / f"{DRAFTER}-inputs.pt")
    torch.save({"input_ids": ids, "pixel_values": sequence.pixel_values, "image_grid_thw": sequence.image_grid_thw},
               work / f"{DRAFTER}-conversation.pt")
    reference = reference_of(drafter, hidden, target_taps=taps)
    jobs, references = [], {}
    for fmt in formats:
        out = work / f"{DRAFTER}-{fmt}"
        DFLASH.exporters[fmt](drafter, str(out), target.path, config)
        if old_mrope_fields:
            _write_mrope_fields(out, config.text_config.rope_parameters)
        job = Job(id=f"dflash/{DRAFTER}/{fmt}", variant="dflash", drafter=DRAFTER, format=fmt, export=str(out),
                  target=target.path, inputs=str(work / f"{DRAFTER}-inputs.pt"), block_size=BLOCK_SIZE,
                  vllm_v2_runner=True, conversation=str(work / f"{DRAFTER}-conversation.pt"))
        jobs.append(job)
        references[job.id] = reference
    return jobs, references, target


def _write_mrope_fields(export: Path, target_rope: dict) -> None:
    """The target's M-RoPE fields in the export's rope_parameters (the dflash format's top level, the speculators
    format's `transformer_layer_config`), as written before the fix: vLLM then builds an M-RoPE drafter, and its V1
    proposer refuses it."""
    path = export / "config.json"
    config = json.loads(path.read_text())
    layer = config.get("transformer_layer_config", config)
    layer["rope_parameters"] |= {k: v for k, v in target_rope.items() if k in MROPE_KEYS}
    path.write_text(json.dumps(config, indent=2))
