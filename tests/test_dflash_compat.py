"""Our speculative loop against the reference `dflash` package's own loop on our export (tiny target, fp32, CPU).

`dflash.model.dflash_generate` (PyPI dflash 0.1.0) loads our export with `DFlashDraftModel.from_pretrained`
and runs its own draft / verify / crop loop. For the same target and prompt it must commit the same tokens
with the same per-step acceptance lengths as `speculative_generate`, hence the same tau. The drafter is
partly fitted to the target's greedy continuations (tests/eval_helpers.py: a few dozen steps of the real
training loss), so steps accept 1 .. B tokens; an untrained drafter (acceptance ~1) is checked too.

Shim (the only one): with `return_stats=True` the reference times itself with `_cuda_time()`, which calls
`torch.cuda.synchronize()` unconditionally and raises "Torch not compiled with CUDA enabled" on a CPU-only
torch. The test replaces `_cuda_time` with `time.perf_counter` (timing only; no effect on tokens).
The reference passes `past_key_values=` to the target, which transformers 5.24 still accepts (with a
FutureWarning: it is renamed `cache`, removal announced for 5.40); nothing else needed a change.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.eval.speculative import speculative_generate
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)
from tests.eval_helpers import fitted, proposer_for

pytest.importorskip("dflash", reason="the reference `dflash` package is not installed")
import dflash.model as dflash_model  # noqa: E402 (installed but broken must fail, not skip)


@pytest.fixture(autouse=True)
def _cpu_timer(monkeypatch):
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def _reference(export_dir, variant: str = "dflash"):
    cls = dflash_model.DFlash2DraftModel if variant == "dflash2" else dflash_model.DFlashDraftModel
    model = cls.from_pretrained(str(export_dir), dtype=torch.float32)
    return model.eval()


def _both(ref_model, drafter, target, prompt, *, block_size, max_new, stop):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename in transformers 5
        ref = dflash_model.dflash_generate(ref_model, target, prompt[None], max_new_tokens=max_new,
                                           stop_token_ids=list(stop), temperature=0.0, block_size=block_size,
                                           return_stats=True)
    ours = speculative_generate(target, proposer_for(drafter, target), prompt, block_size=block_size,
                                tap_layer_ids=drafter.spec.tap_layer_ids, max_new_tokens=max_new, stop_token_ids=stop)
    return ref, ours


def _first_inside_a_step(output_ids: list[int], lengths: list[int]):
    """Index of the first token that occurs for the first time inside a step's accepted run (not as the
    step's last token), or None. Index 0 is the prefill's token; step k commits the next lengths[k] tokens."""
    end = 0
    for n in lengths:
        for j in range(end + 1, end + n):
            if output_ids.index(output_ids[j]) == j:
                return j
        end += n
    return None


@pytest.mark.parametrize("block_size, variant", [(4, "dflash"), (6, "dflash"), (4, "dflash2")])
def test_same_tokens_and_acceptance_lengths_as_reference_loop(tmp_path, block_size, variant):
    """DFlash2: the reference's `DFlash2DraftModel` and its loop (the selector's greedy walk) on our export."""
    setup = fitted(variant=variant)
    export_drafter(setup.drafter, tmp_path, target_config=setup.target.config)
    ref_model = _reference(tmp_path, variant)
    assert ref_model.target_layer_ids == list(setup.drafter.spec.tap_layer_ids)
    seen = []
    for i, prompt in enumerate(setup.prompts):
        max_new = 18 + 3 * i  # some runs end mid-block: the last step is cut by max_new_tokens
        ref, ours = _both(ref_model, setup.drafter, setup.target, prompt, block_size=block_size, max_new=max_new, stop=())
        assert ref.output_ids[0, : prompt.shape[0]].tolist() == prompt.tolist()
        assert ref.output_ids[0, prompt.shape[0]:].tolist() == ours.output_ids
        assert ref.acceptance_lengths == ours.acceptance_lengths, i
        seen += ours.acceptance_lengths
    assert max(seen) >= 3 and 1 in seen  # non-trivial acceptance, and rejections
    tau = sum(seen) / len(seen)
    assert 1.2 < tau < block_size


def test_same_accounting_with_stop_token_and_untrained_drafter(tmp_path):
    setup = fitted()
    export_drafter(setup.drafter, tmp_path / "fitted", target_config=setup.target.config)
    ref_model = _reference(tmp_path / "fitted")
    cut_steps = 0
    for prompt in setup.prompts:  # a stop token inside an accepted run ends both loops mid-step
        free = speculative_generate(setup.target, proposer_for(setup.drafter, setup.target), prompt, block_size=4,
                                    tap_layer_ids=setup.drafter.spec.tap_layer_ids, max_new_tokens=24, stop_token_ids=[])
        stop_at = _first_inside_a_step(free.output_ids, free.acceptance_lengths)
        if stop_at is None:
            continue
        stop = free.output_ids[stop_at]
        ref, ours = _both(ref_model, setup.drafter, setup.target, prompt, block_size=4, max_new=24, stop=[stop])
        assert ref.output_ids[0, prompt.shape[0]:].tolist() == ours.output_ids and len(ours.output_ids) == stop_at + 1
        assert ref.acceptance_lengths == ours.acceptance_lengths
        cut_steps += ours.acceptance_lengths[-1] < free.acceptance_lengths[len(ours.acceptance_lengths) - 1]
    assert cut_steps >= 2
    untrained = tiny_drafter(seed=5)[0]
    export_drafter(untrained, tmp_path / "untrained", target_config=setup.target.config)
    ref_model = _reference(tmp_path / "untrained")
    for prompt in setup.prompts[:2]:
        ref, ours = _both(ref_model, untrained, setup.target, prompt, block_size=4, max_new=16, stop=())
        assert ref.output_ids[0, prompt.shape[0]:].tolist() == ours.output_ids
        assert ref.acceptance_lengths == ours.acceptance_lengths
