"""The collective benchmark: the registry of collectives, sizes, known inputs, the compiled program with
its HLO check, correctness check and timing, the sweep, and a whole run."""
