"""DSpark on CUDA (skipped on CPU; run on the device machine): its loss chunks compiled by Inductor (what CUDA trains
with, `drafter.loss_kernel: compiled`) give eager's sums, hits and gradients, and a colocated bf16 run trains and
evaluates with them."""

import pytest
import torch

from tests.test_dspark_train import CASES, check_compiled_chunks
from tests.test_gpu import train_on_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("case", sorted(CASES))
def test_dspark_loss_chunks_compiled_by_inductor_give_eagers_values(case):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on both sides: compare the kernels, not TF32
    check_compiled_chunks(case, "cuda", "inductor", tol=1e-4)


def test_dspark_colocated_training_and_eval_run_on_cuda(tmp_path):
    summary = train_on_cuda(tmp_path, "drafter.variant=dspark", "drafter.block_size=15", "drafter.kd_weight=0.9")
    ev = summary["eval"]
    assert sum(ev["acceptance_histogram"]) > 0 and ev["val"]["walk_steps"] > 0
