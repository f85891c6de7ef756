"""GPU paths (skipped on CPU; run on the device machine): compiled flex attention against the SDPA
reference path, and a colocated training run on CUDA."""

import json

import pytest
import torch

from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.loss import drafter_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _batch(spec, device, seqlens=(700, 900, 300), num_slots=2048, num_blocks=256):
    gen = torch.Generator().manual_seed(0)
    total = sum(seqlens)
    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist() + [total] * 2, dtype=torch.int32)
    ids = torch.randint(0, 1000, (num_slots,), generator=gen)
    mask = torch.rand(num_slots, generator=gen) > 0.2
    mask[total:] = False
    ids[total:] = 0
    taps = torch.randn(num_slots, spec.num_taps * spec.hidden_size, generator=gen)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.02
    ids, mask, cu, taps, embed = (t.to(device) for t in (ids, mask, cu, taps, embed))
    plan = plan_blocks(input_ids=ids, loss_mask=mask, cu_seqlens=cu, num_blocks=num_blocks, block_size=spec.block_size,
                       mask_token_id=spec.mask_token_id, seed=0, epoch=0, job_id=0)
    return taps, cu, plan, embed


def test_compiled_flex_matches_sdpa_forward_and_backward():
    from transformers import Qwen3Config

    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.drafter.spec import drafter_spec

    device = torch.device("cuda")
    target = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    spec = drafter_spec(target, DrafterConfig(num_layers=2, block_size=16, tap_layer_ids=[1, 3, 5]), mask_token_id=4000)
    torch.manual_seed(0)
    flex = DFlashDrafter(spec, attention="flex").to(device)
    with torch.no_grad():
        flex.init_weights()
    sdpa = DFlashDrafter(spec, attention="sdpa").to(device)
    sdpa.load_state_dict(flex.state_dict())
    taps, cu, plan, embed = _batch(spec, device)
    lm_head = embed.clone()
    compiled = torch.compile(flex.forward_train)
    outs = {}
    for name, model, fwd in (("flex", flex, compiled), ("sdpa", sdpa, sdpa.forward_train)):
        masks = model.build_masks(plan, cu, taps.shape[0])
        hidden = fwd(taps=taps, cu_seqlens=cu, plan=plan, embed_weight=embed, masks=masks)
        loss = drafter_loss(hidden, plan, lm_head_weight=lm_head, gamma=7.0, chunk_rows=1024)
        loss.loss_sum.backward()
        outs[name] = (hidden.detach(), loss.loss_sum.detach(), model.fc.weight.grad.clone())
    torch.testing.assert_close(outs["flex"][0], outs["sdpa"][0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(outs["flex"][1], outs["sdpa"][1], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(outs["flex"][2], outs["sdpa"][2], atol=1e-4, rtol=1e-3)


def train_on_cuda(tmp_path, *overrides: str) -> dict:
    """A colocated 6-step bf16 demo run on CUDA with compiled flex attention and `overrides`: checks it ended ok with
    six finite losses, and returns its summary."""
    from dflash_trainer.cli import main

    run = tmp_path / "run"
    rc = main(["train", "--config", "demo", f"run.dir={run}", "run.device=cuda", "target.dtype=bfloat16",
               "train.dtype=bfloat16", "drafter.attention=flex", "train.max_steps=6", "train.num_epochs=1",
               "data.max_conversations=120", "logging.progress=false", f"data.cache_dir={tmp_path / 'cache'}",
               *overrides])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 6
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6 and all(isinstance(x, float) and x > 0 for x in losses)  # finite (NaN is logged null)
    return summary


def test_colocated_training_and_eval_run_on_cuda(tmp_path):
    ev = train_on_cuda(tmp_path)["eval"]
    # the batched evaluation, prompt lookup and the held-out validation (compiled training forward) all ran
    assert ev["greedy_match_rate"] is not None and ev["prompt_lookup_tau"] >= 1.0
    assert ev["val"]["anchors"] > 0 and ev["val"]["walk_steps"] > 0 and 1.0 <= ev["val"]["walk_tau"] <= 8.0
    assert sum(ev["acceptance_histogram"]) > 0
