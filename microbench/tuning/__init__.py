"""What XLA and NCCL read, written from this toolkit's checked measurements: XLA:GPU's collective performance
table and speed-of-light latency options, NCCL's tuner table (docs/tuning.md).

The measurements stay in the run folders; these modules only turn them into the formats the compiler and the
library read, and say where those formats would be silently ignored.
"""
