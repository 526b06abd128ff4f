"""microbench: nccl-tests-style collective benchmarks and parallel-training throughput for JAX."""

from microbench.aot import quiet_start as _quiet_start

_quiet_start.start_quietly()  # before any module of the package imports jax

__version__ = "0.1.0"
