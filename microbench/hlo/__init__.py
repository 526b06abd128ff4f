"""Reading compiled XLA programs: the collective instructions of an HLO module, their groups and sizes."""
