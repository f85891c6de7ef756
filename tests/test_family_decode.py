"""Lossless speculative decoding on the target families whose layers are not plain attention: hybrid targets'
recurrent layers (Gated DeltaNet, Mamba-2) take every fed token, so each row's rejected drafts must leave their
states; Llama 4's chunked attention; Gemma 4's sliding layers and DeepSeek-V3's MLA. Drafts come from an oracle that knows the target's own greedy continuation and
gets a different number of tokens right each step, so blocks are accepted in part, in full and not at all."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from dflash_trainer.eval.batched import BlockDrafts, ContextUpdate, decode_batch
from dflash_trainer.eval.speculative import target_generate
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from tests.drafter_helpers import single_thread  # noqa: F401 (autouse fixture)


class OracleProposer:
    """Drafts the reference continuation of each row, right for the first `(step + row) % block` tokens, then wrong."""

    needs_taps = False

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.sequences, self.vocab, self.step = sequences, vocab, 0
        self.rows = list(range(len(sequences)))

    def observe(self, update: ContextUpdate) -> None:
        pass

    def keep(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[r] for r in rows.tolist()]

    def propose(self, last_tokens, starts, max_lengths, block_size: int, temperature: float,
                generator: Optional[torch.Generator]) -> BlockDrafts:
        self.step += 1
        tokens = torch.zeros((len(self.rows), block_size - 1), dtype=torch.int64)
        for r, prompt in enumerate(self.rows):
            start, sequence = int(starts[r]), self.sequences[prompt]
            right = (self.step + prompt) % block_size
            for j in range(block_size - 1):
                truth = sequence[start + 1 + j] if start + 1 + j < len(sequence) else 0
                tokens[r, j] = truth if j < right else (truth + 1) % self.vocab
        return BlockDrafts(tokens=tokens, lengths=max_lengths.clone())


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3-next", "tiny-nemotron-h", "tiny-llama4", "tiny-gemma4",
                                    "tiny-deepseek-v3", "tiny-qwen3.5-vl", "tiny-gemma3-vl",
                                    "tiny-gemma4-vl", "tiny-llama4-vl"])
def test_speculative_decoding_is_lossless_on_hybrid_and_chunked_targets(preset):
    target = load_target(TargetConfig(random_init=preset, dtype="float32", compile=False), torch.device("cpu"), seed=0)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=generator) for n in (12, 5, 20, 9)]
    new = 24
    alone = [target_generate(target, p, max_new_tokens=new, stop_token_ids=[]).output_ids for p in prompts]
    sequences = [p.tolist() + a for p, a in zip(prompts, alone)]
    proposer = OracleProposer(sequences, vocab=1000)
    out = decode_batch(target, prompts, proposer=proposer, block_size=6, max_new_tokens=new, stop_token_ids=[])
    for result, reference in zip(out, alone):
        assert result.output_ids == reference
    lengths = [n for result in out for n in result.acceptance_lengths]
    assert max(lengths) == 6 and min(lengths) == 1 and len(set(lengths)) > 3  # whole, none and partial blocks
    plain = decode_batch(target, prompts, max_new_tokens=new, stop_token_ids=[])  # left-padded rows, compaction
    assert [r.output_ids for r in plain] == alone
