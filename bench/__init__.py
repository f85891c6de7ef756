"""The benchmarks: scripts and device suites grouped by the claim they back (bench/README.md). A package only so
that the scripts import their shared helpers (`bench.common`, `bench.flops`, `bench.kernel_profile`) the same way
whether run as files (`python bench/speed/run.py`) or as modules (`python -m bench.speed.run`)."""
