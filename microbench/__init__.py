"""microbench: nccl-tests-style collective benchmarks and parallel-training throughput for JAX."""

__version__ = "0.1.0"
