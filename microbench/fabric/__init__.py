"""The machine's fabric as data, and the models that run on it: link peaks per level (`peaks.py`), the
fabric's description per system (`description.py`), collective times predicted on it (`collectives.py`)
and flows sharing its links max-min fairly (`flows.py`). Below `report/` and `study/`, which both use it."""
