"""The collective benchmark: the registry of collectives, sizes, known inputs, the check and timed programs
with their HLO check, the correctness check and timing by difference, the sweep, and a whole run."""
