"""Speculative decoding: exact output and exact tau on hand-built proposers (tiny target, CPU, fp32)."""

import pytest
import torch

from dflash_trainer.eval.speculative import Draft, speculative_generate, target_generate

TAPS = [1, 3]


class OracleProposer:
    """Proposes the target's own greedy continuation (always right) or a shifted one (always wrong)."""

    def __init__(self, greedy, prompt_len, vocab, wrong=False):
        self.greedy, self.n, self.vocab, self.wrong = greedy, prompt_len, vocab, wrong
        self.context_positions = []

    def reset(self):
        self.context_positions = []

    def add_context(self, taps, positions):
        assert taps.shape[0] == positions.shape[0]
        self.context_positions.extend(positions.tolist())

    def propose(self, first_token, start, block_size, temperature, generator):
        # context must be exactly the positions before the block
        assert self.context_positions == list(range(start))
        toks = torch.tensor([self.greedy[start + k - self.n] for k in range(1, block_size)])
        if self.wrong:
            toks = (toks + 1) % self.vocab
        return Draft(tokens=toks)


def _prompt():
    return torch.tensor([5, 17, 99, 3, 250, 7, 8, 9])


@pytest.mark.parametrize("block_size, max_new", [(4, 23), (8, 30), (16, 16)])
def test_always_right_drafter_gives_tau_block_size_except_cut_last_step(tiny_target, block_size, max_new):
    ref = target_generate(tiny_target, _prompt(), max_new_tokens=max_new + 40, stop_token_ids=[])
    proposer = OracleProposer(ref.output_ids, len(_prompt()), tiny_target.config.vocab_size)
    out = speculative_generate(tiny_target, proposer, _prompt(), block_size=block_size, tap_layer_ids=TAPS,
                               max_new_tokens=max_new, stop_token_ids=[])
    assert out.output_ids == ref.output_ids[:max_new]
    full, rest = divmod(max_new - 1, block_size)
    assert out.acceptance_lengths == [block_size] * full + ([rest] if rest else [])
    assert out.stop_reason == "max_new_tokens"


def test_always_wrong_drafter_gives_tau_one(tiny_target):
    ref = target_generate(tiny_target, _prompt(), max_new_tokens=60, stop_token_ids=[])
    proposer = OracleProposer(ref.output_ids, len(_prompt()), tiny_target.config.vocab_size, wrong=True)
    out = speculative_generate(tiny_target, proposer, _prompt(), block_size=8, tap_layer_ids=TAPS,
                               max_new_tokens=20, stop_token_ids=[])
    assert out.output_ids == ref.output_ids[:20]
    assert out.acceptance_lengths == [1] * 19


def test_stop_token_ends_generation_and_counts_cut_step(tiny_target):
    ref = target_generate(tiny_target, _prompt(), max_new_tokens=40, stop_token_ids=[])
    stop = ref.output_ids[10]
    first_stop = ref.output_ids.index(stop)
    proposer = OracleProposer(ref.output_ids, len(_prompt()), tiny_target.config.vocab_size)
    out = speculative_generate(tiny_target, proposer, _prompt(), block_size=4, tap_layer_ids=TAPS,
                               max_new_tokens=40, stop_token_ids=[stop])
    assert out.output_ids == ref.output_ids[: first_stop + 1]
    assert out.stop_reason == "eos"
    assert sum(out.acceptance_lengths) == len(out.output_ids) - 1


def test_decoding_runs_compiled_target_layers_eager(tiny_target):
    """Tap capture compiles the target's layers (target.compile); decoding must never compile them."""
    from dflash_trainer.target.capture import compile_decoder_layers

    ref = target_generate(tiny_target, _prompt(), max_new_tokens=12, stop_token_ids=[])
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_decoder_layers(tiny_target, backend=counting_backend)
    try:
        tiny_target.model.layers[0](torch.randn(1, 5, tiny_target.config.hidden_size),
                                    position_embeddings=tiny_target.model.rotary_emb(
                                        torch.randn(1, 5, 1), torch.arange(5)[None]))
        assert graphs, "the check is void: a direct call of a compiled layer compiled nothing"
        compiled_before = len(graphs)
        out = target_generate(tiny_target, _prompt(), max_new_tokens=12, stop_token_ids=[])
        assert out.output_ids == ref.output_ids
        assert len(graphs) == compiled_before  # no graph was compiled while decoding
    finally:
        for layer in tiny_target.model.layers:
            layer.__dict__.pop("forward", None)
        torch._dynamo.reset()
