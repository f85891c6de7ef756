"""bench/target/target_forward.py: the FP8 speedup it derives, and --quantize fp8 refused without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the `bench` package

from bench.target.target_forward import summarize  # noqa: E402


def rows_of(quantize, ms_by_mode, compiled=True, budget=8192):
    return [dict(quantize=quantize, compiled=compiled, budget=budget, mode=mode, ms=ms)
            for mode, ms in ms_by_mode.items()]


def test_fp8_speedup_is_the_bf16_capture_time_over_the_fp8_one_at_the_same_budget_and_compilation():
    rows = (rows_of("none", dict(full=20.0, to_tap=15.0, capture=15.3))
            + rows_of("none", dict(full=10.0, to_tap=7.0, capture=7.5), budget=4096)
            + rows_of("fp8", dict(full=12.0, to_tap=9.0, capture=9.0))
            + rows_of("fp8", dict(full=6.0, to_tap=5.0, capture=5.0), budget=4096))
    by = {(s["quantize"], s["budget"]): s for s in summarize(rows)}
    assert by[("none", 8192)]["fp8_speedup"] is None
    assert abs(by[("fp8", 8192)]["fp8_speedup"] - 15.3 / 9.0) < 1e-12
    assert abs(by[("fp8", 4096)]["fp8_speedup"] - 1.5) < 1e-12
    assert abs(by[("fp8", 8192)]["early_exit_saving"] - 0.25) < 1e-12


def test_fp8_alone_has_no_speedup_to_report():
    assert summarize(rows_of("fp8", dict(full=12.0, to_tap=9.0, capture=9.0)))[0]["fp8_speedup"] is None


def test_quantize_fp8_on_the_cpu_is_refused_before_loading():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "target" / "target_forward.py"), "--smoke", "--quantize", "fp8"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
