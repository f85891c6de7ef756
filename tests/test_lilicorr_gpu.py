"""LiLiCorr on CUDA (skipped on CPU; run on the device machine): a colocated bf16 run with compiled flex attention
trains the lattice terms (the penalty from the captured last hidden state included) to finite losses, and its
evaluation walks the lattice losslessly; the head and its terms compiled by Inductor (what CUDA trains with) give
eager's values and gradients."""

import json

import pytest
import torch

from tests.test_gpu import train_on_cuda
from tests.test_lilicorr import check_lattice_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("conv", ["false", "true"])
def test_lilicorr_colocated_training_and_eval_run_on_cuda(conv, tmp_path):
    summary = train_on_cuda(tmp_path, "drafter.variant=lilicorr", f"drafter.lilicorr_conv={conv}",
                            "drafter.lilicorr_w_margin=0.1")
    run = tmp_path / "run"
    ev = summary["eval"]
    assert ev["greedy_match_rate"] is not None and sum(ev["acceptance_histogram"]) > 0  # bf16: not always 1
    assert ev["val"]["walk_steps"] > 0 and 1.0 <= ev["val"]["walk_tau"] <= 8.0
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]


@pytest.mark.parametrize("pen", [True, False])
def test_the_lattice_kernel_compiled_by_inductor_gives_eagers_values_and_gradients(pen):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on both sides: compare the kernels, not TF32
    check_lattice_kernel(pen, "cuda", "inductor", tol=1e-4)
