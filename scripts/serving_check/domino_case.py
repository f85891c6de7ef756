"""The Domino case: `dflash-train eval`'s drafting of a Domino drafter (ModelOpt's `projector_type: domino`, read from
its exports for evaluation, `drafter/domino.py`) against SGLang's own rollout, `domino_utils.domino_greedy_rollout`
(what its DFlash draft worker calls for a Domino drafter), on the same block hidden states, target embedding and LM
head, with the whole vocabulary scored (`--speculative-domino-candidate-pool-size 0`), in fp32 and in bf16 (as SGLang
serves it: there the rounding of a slot's bf16 logits plus its correction decides near-ties). SGLang's default pool of 2,048
candidates is an approximation of that argmax; how many drafts it changes is reported, not judged. vLLM does not
serve Domino. The correction head's modules are ours, loaded from our export of the drafter under the names
SGLang's `DFlashDraftModel.load_weights` reads (`prefix_gru.*`, `embed_proj.*`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from dflash_trainer.drafter.domino import domino_walk
from dflash_trainer.drafter.export import export_drafter, load_drafter
from dflash_trainer.drafter.model import DFlashDrafter
from serving_check.variants import DFLASH, Shape

ROWS, BLOCK = 32, 8


def check_domino(work: Path, target, target_config) -> dict:
    """{"alike": drafts equal to SGLang's at pool 0, "total": drafts compared, "pool_2048_alike": at SGLang's default
    pool, "moved": drafts the correction head moved off the backbone's argmax}; `target` the check's tiny target
    (its embedding and LM head) and its HF config."""
    from sglang.srt.speculative.domino_utils import domino_greedy_rollout

    torch.manual_seed(7)
    spec = DFLASH.build(Shape(name="domino", num_layers=1), BLOCK, target_config).spec
    domino = dataclasses.replace(spec, variant="domino", block_size=BLOCK, domino_gru_hidden=24, domino_emb_dim=16)
    drafter = DFlashDrafter(domino).float()
    with torch.no_grad():  # a head strong enough to move picks: the comparison then covers the correction
        drafter.embed_proj[2].weight.normal_(0.0, 1.0)
    export = export_drafter(drafter, work / "domino-export")
    ours = load_drafter(export).float().eval()
    assert set(load_file(str(export / "model.safetensors"))) >= {"prefix_gru.weight_ih_l0", "embed_proj.2.weight"}
    counts = {"alike": 0, "total": 0, "pool_2048_alike": 0, "moved": 0}
    # fp32, and bf16 as SGLang serves it (where the sum's rounding decides near-ties), on the same draws
    hidden = torch.randn(ROWS, BLOCK, domino.hidden_size)  # (R, B, H): the backbone's output for a block of B
    anchors = torch.randint(0, domino.vocab_size, (ROWS,))
    for dtype in (torch.float32, torch.bfloat16):
        model = ours.to(dtype)
        embed, head, h = target.embed.to(dtype), target.head.to(dtype), hidden.to(dtype)  # (V, H), (V, H), (R, B, H)
        mine = domino_walk(model.prefix_gru, model.embed_proj, h[:, :-1], head, embed, anchors, 0.0).tokens  # (R, B-1)
        embedding = nn.Embedding.from_pretrained(embed)

        def sglang(pool: int) -> torch.Tensor:
            return domino_greedy_rollout(draft_hidden=h, bonus_tokens=anchors, target_embedding=embedding,
                                         lm_head_weight=head, prefix_gru=model.prefix_gru, embed_proj=model.embed_proj,
                                         vocab_size=domino.vocab_size, shift_label=True, candidate_pool_size=pool,
                                         in_cuda_graph=False)  # (R, B-1)

        base = (h[:, :-1] @ head.T).argmax(-1)
        counts["alike"] += int((sglang(0) == mine).sum())
        counts["total"] += mine.numel()
        counts["pool_2048_alike"] += int((sglang(2048) == mine).sum())
        counts["moved"] += int((mine != base).sum())
    return counts
