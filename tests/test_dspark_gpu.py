"""DSpark on CUDA (skipped on CPU; run on the device machine): its loss chunks compiled by Inductor (what CUDA trains
with, `drafter.loss_kernel: compiled`) give eager's sums, hits and gradients, and a colocated bf16 run trains and
evaluates with them."""

import pytest
import torch

from dflash_trainer.drafter.dspark import compiled_chunk_losses, markov_loss
from tests.test_dspark_train import CASES, check_compiled_chunks, dspark
from tests.test_gpu import train_on_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("case", sorted(CASES))
def test_dspark_loss_chunks_compiled_by_inductor_give_eagers_values(case, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 matmuls: compare kernels
    check_compiled_chunks(case, "cuda", "inductor", tol=1e-4)


def test_a_cuda_dspark_drafter_trains_with_the_compiled_chunks():
    drafter, _ = dspark()
    drafter.to("cuda")
    assert markov_loss(drafter, "l1", compiled=True).chunk_kernel is compiled_chunk_losses()
    assert markov_loss(drafter, "l1", compiled=False).chunk_kernel is not compiled_chunk_losses()


def test_dspark_colocated_training_and_eval_run_on_cuda(tmp_path):
    summary = train_on_cuda(tmp_path, "drafter.variant=dspark", "drafter.block_size=15", "drafter.kd_weight=0.9")
    ev = summary["eval"]
    assert sum(ev["acceptance_histogram"]) > 0 and ev["val"]["walk_steps"] > 0
