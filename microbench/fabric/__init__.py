"""What a machine is and what a collective costs on it, as data and formulas; JAX-free, the lowest layer.

GPU kinds with their sources (`gpu_kinds.py`, one file each in `gpu_specs/`, read and source-checked by `spec_files.py`), link rates as people write them
(`rates.py`), TPU kinds with their sources (`tpu_kinds.py`, `tpu_specs/`) and TPU pods as tori with collectives
(`torus.py`), what a collective moves and its steps (`conventions.py`), link peaks per fabric level
(`link_peaks.py`), the described systems (`description.py`), collective times predicted on a fabric
(`collective_model.py`), flows sharing its links max-min fairly (`flows.py`) and jobs placed on it (`jobs.py`). Every other layer takes these facts from here.
"""
