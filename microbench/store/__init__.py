"""The results store: every finished run kept in one database (SQLite beside the run folders by default,
PostgreSQL for a fleet), keyed by its machine, so a run can be judged against that machine's own past.

The run folder stays the source of truth: the store is an index of folders (`microbench-report --index`
rebuilds it), never the only copy of a figure.
"""
