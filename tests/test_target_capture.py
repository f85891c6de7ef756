"""Tap capture on the tiny target: the tap convention, padding, packing, early exit, start-time checks."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dflash_trainer.data.types import TokenizedSequence
from dflash_trainer.errors import ConfigError
from dflash_trainer.target import checks
from dflash_trainer.target.capture import TapCapture, prepare_inputs
from dflash_trainer.target.checks import check_target, choose_tap_layer_ids, slow_path_warnings
from dflash_trainer.target.load import find_decoder_layers
from dflash_trainer.transport.wire import WireSpec, allocate

H = 64  # tiny preset hidden size
LENGTHS = (9, 17, 4, 17)


def make_sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedSequence(
            input_ids=torch.randint(0, 300, (n,), generator=g), loss_mask=torch.rand(n, generator=g) > 0.4
        )
        for n in lengths
    ]


def capture(model, sequences, taps, *, last_hidden=False, token_budget=64, max_seqs=6, pad_to=None):
    spec = WireSpec(
        token_budget=token_budget, max_seqs=max_seqs, num_taps=len(taps), hidden=H,
        dtype=torch.float32, has_last_hidden=last_hidden,
    )
    out = allocate(spec, "cpu")
    inputs = prepare_inputs(sequences, out, pad_to=pad_to)
    TapCapture(model, taps, capture_last_hidden=last_hidden).run(inputs, out)
    return inputs, out


def alone_hidden_states(model, seq):
    with torch.no_grad():
        return model(seq.input_ids[None], output_hidden_states=True).hidden_states


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("taps", [[0], [1, 3], [0, 2, 4], [4, 1, 2]])
def test_taps_equal_hf_hidden_states_of_each_sequence_alone(tiny_target, taps, attn_implementation):
    # The padded batch runs without an attention mask: right padding never reaches a real token.
    tiny_target.set_attn_implementation(attn_implementation)
    sequences = make_sequences(LENGTHS)
    inputs, out = capture(tiny_target, sequences, taps)
    assert inputs.padded_tokens == 4 * 17 and inputs.input_ids.shape == (4, 17)
    start = 0
    for seq in sequences:
        hs = alone_hidden_states(tiny_target, seq)
        n = seq.num_tokens
        for k, layer in enumerate(taps):
            got = out.taps[start : start + n, k * H : (k + 1) * H]
            torch.testing.assert_close(got, hs[layer + 1][0], atol=1e-5, rtol=1e-5)
            # The off-by-one this guards against: hidden_states[layer] is the layer's input, not its output.
            assert not torch.allclose(got, hs[layer][0], atol=1e-3)
        start += n
    assert not out.taps.requires_grad


def test_padding_further_leaves_each_sequences_taps_as_it_runs_alone(tiny_target):
    sequences = make_sequences((41, 33, 9))
    inputs, out = capture(tiny_target, sequences, [1, 3], token_budget=128, pad_to=54)
    assert inputs.input_ids.shape == (3, 54) and inputs.padded_tokens == 3 * 54
    start = 0
    for seq in sequences:
        hs, n = alone_hidden_states(tiny_target, seq), seq.num_tokens
        for k, layer in enumerate([1, 3]):
            torch.testing.assert_close(out.taps[start : start + n, k * H : (k + 1) * H], hs[layer + 1][0],
                                       atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("cudnn_attention", [True, False])
def test_cudnn_attention_off_takes_sdpa_off_cudnn_for_the_forward_alone(tiny_target, cudnn_attention):
    seen = []
    handle = find_decoder_layers(tiny_target)[0].register_forward_pre_hook(
        lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    spec = WireSpec(token_budget=64, max_seqs=6, num_taps=1, hidden=H, dtype=torch.float32, has_last_hidden=False)
    out = allocate(spec, "cpu")
    try:
        TapCapture(tiny_target, [2], cudnn_attention=cudnn_attention).run(prepare_inputs(make_sequences(LENGTHS), out),
                                                                          out)
    finally:
        handle.remove()
    assert before and seen == [cudnn_attention]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored after the forward
    default_out = allocate(spec, "cpu")
    TapCapture(tiny_target, [2]).run(prepare_inputs(make_sequences(LENGTHS), default_out), default_out)
    torch.testing.assert_close(out.taps, default_out.taps)


def test_last_hidden_is_the_last_layer_output_before_the_final_norm(tiny_target):
    sequences = make_sequences((5, 11))
    _, out = capture(tiny_target, sequences, [1, 3], last_hidden=True)
    start = 0
    for seq in sequences:
        hs = alone_hidden_states(tiny_target, seq)
        n = seq.num_tokens
        last = out.last_hidden[start : start + n]
        # transformers 5: hidden_states[-1] is after the final norm; ours is before it.
        torch.testing.assert_close(tiny_target.model.norm(last), hs[-1][0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(last, hs[-1][0], atol=1e-3)
        start += n


def test_packing_writes_ids_mask_and_cu_seqlens_and_unpacks(tiny_target):
    sequences = make_sequences(LENGTHS, seed=3)
    inputs, out = capture(tiny_target, sequences, [0, 2])
    n = sum(LENGTHS)
    assert inputs.num_tokens == n and inputs.num_seqs == len(LENGTHS)
    assert out.cu_seqlens.tolist() == [0, 9, 26, 30, n, n, n]
    torch.testing.assert_close(out.input_ids[:n], torch.cat([s.input_ids for s in sequences]))
    assert torch.equal(out.loss_mask[:n].bool(), torch.cat([s.loss_mask for s in sequences]))
    assert out.input_ids[n:].eq(0).all() and out.loss_mask[n:].eq(0).all()
    cu = out.cu_seqlens.tolist()
    for i, seq in enumerate(sequences):  # unpack by cu_seqlens
        assert torch.equal(out.input_ids[cu[i] : cu[i + 1]], seq.input_ids)


def test_equal_lengths_are_not_padded_and_rerun_overwrites_the_buffer(tiny_target):
    sequences = make_sequences((8, 8))
    spec = WireSpec(token_budget=32, max_seqs=4, num_taps=1, hidden=H, dtype=torch.float32, has_last_hidden=False)
    out = allocate(spec, "cpu")
    cap = TapCapture(tiny_target, [2])
    inputs = prepare_inputs(sequences, out)
    assert inputs.padded_tokens == inputs.num_tokens == 16
    cap.run(inputs, out)
    first = out.taps[:16].clone()
    cap.run(prepare_inputs(make_sequences((16,), seed=7), out), out)
    assert not torch.allclose(out.taps[:16], first)
    cap.run(prepare_inputs(sequences, out), out)
    torch.testing.assert_close(out.taps[:16], first)


def count_calls(model):
    counts = {"layers": 0, "norm": 0, "lm_head": 0}

    def counter(key):
        def hook(module, args):
            counts[key] += 1

        return hook

    handles = [layer.register_forward_pre_hook(counter("layers")) for layer in find_decoder_layers(model)]
    handles.append(model.model.norm.register_forward_pre_hook(counter("norm")))
    handles.append(model.lm_head.register_forward_pre_hook(counter("lm_head")))
    return counts, handles


@pytest.mark.parametrize("taps,last_hidden,layers_run", [([1, 2], False, 3), ([0], False, 1), ([1, 2], True, 6)])
def test_early_exit_runs_only_up_to_the_stop_layer(tiny_target, taps, last_hidden, layers_run):
    hooks_before = [len(layer._forward_hooks) for layer in find_decoder_layers(tiny_target)]
    counts, handles = count_calls(tiny_target)
    capture(tiny_target, make_sequences((6, 3)), taps, last_hidden=last_hidden)
    assert counts == {"layers": layers_run, "norm": 0, "lm_head": 0}
    # capture hooks are removed after the run
    assert [len(layer._forward_hooks) for layer in find_decoder_layers(tiny_target)] == hooks_before
    for h in handles:
        h.remove()
    counts, handles = count_calls(tiny_target)
    with torch.no_grad():
        tiny_target(torch.ones(1, 4, dtype=torch.int64))
    assert counts == {"layers": 6, "norm": 1, "lm_head": 1}  # the model itself is untouched


def test_tap_on_last_layer_is_refused(tiny_target):
    with pytest.raises(ConfigError, match="last layer 5"):
        TapCapture(tiny_target, [1, 5])
    with pytest.raises(ConfigError, match="outside the target's 6 decoder layers"):
        check_target(tiny_target, tap_layer_ids=[1, 6])


def test_mask_token_outside_embedding_is_refused(tiny_target):
    rows = tiny_target.model.embed_tokens.num_embeddings
    facts = check_target(tiny_target, tap_layer_ids=None, mask_token_id=rows - 1, drafter_hidden_size=H, max_length=64)
    assert facts.tap_layer_ids == (0, 1, 2, 3, 4) and facts.num_embeddings == rows
    with pytest.raises(ConfigError, match=f"mask_token_id {rows} is not a row of the target's embedding"):
        check_target(tiny_target, tap_layer_ids=[1], mask_token_id=rows)


def test_other_start_checks(tiny_target):
    with pytest.raises(ConfigError, match="drafter hidden size 32 != target hidden size 64"):
        check_target(tiny_target, tap_layer_ids=[1], drafter_hidden_size=32)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        check_target(tiny_target, tap_layer_ids=[1], max_length=5000)


def test_choose_tap_layer_ids():
    assert choose_tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert choose_tap_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert choose_tap_layer_ids(6, 5) == [0, 1, 2, 3, 4]  # too shallow for [1, L-3]: widened, never the last
    assert choose_tap_layer_ids(36, 1) == [18]
    assert choose_tap_layer_ids(2, 1) == [0]  # the middle of two layers is the last: the first instead
    with pytest.raises(ConfigError, match="cannot choose 1 taps"):
        choose_tap_layer_ids(1, 1)
    for layers in range(2, 80):
        for k in range(1, 8):
            if k <= layers - 1:
                ids = choose_tap_layer_ids(layers, k)
                assert len(set(ids)) == k and max(ids) <= layers - 2 and min(ids) >= 0
    with pytest.raises(ConfigError, match="cannot choose 5 taps"):
        choose_tap_layer_ids(5, 5)


def test_unknown_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*model.model.layers"):
        TapCapture(model, [0])


def test_slow_path_warning_for_linear_attention_without_kernels(monkeypatch):
    class Cfg:
        layer_types = ["linear_attention", "full_attention"]

    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)
    (warning,) = slow_path_warnings(Cfg())
    assert "fla" in warning and "causal_conv1d" in warning
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: object())
    assert slow_path_warnings(Cfg()) == []
    Cfg.layer_types = ["full_attention"]
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)
    assert slow_path_warnings(Cfg()) == []


def test_batch_limits_are_refused(tiny_target):
    spec = WireSpec(token_budget=16, max_seqs=2, num_taps=1, hidden=H, dtype=torch.float32, has_last_hidden=False)
    out = allocate(spec, "cpu")
    with pytest.raises(ValueError, match="token_budget 16"):
        prepare_inputs(make_sequences((10, 7)), out)
    with pytest.raises(ValueError, match="1..2 sequences"):
        prepare_inputs(make_sequences((2, 2, 2)), out)
    with pytest.raises(ValueError, match="lack last_hidden"):
        TapCapture(tiny_target, [1], capture_last_hidden=True).run(prepare_inputs(make_sequences((4,)), out), out)
