"""The multi-tenancy interference study (docs/study.md): how much a training job slows down when
other jobs share the network, by strategy, size, placement and job mix.

`workloads` (GPU rooflines, model shapes, strategies and job sizes), `rank_programs` (the five proxies' message
schedules as data), `step_collectives` (a schedule read from a real training step's compiled HLO), `proxy` (runs a
schedule: real collectives, emulated compute), `machines` (described machines and their placement classes),
`generator` (job mixes: patterns, entropy bins, placement vectors), `placement` (nodes for each job),
`run_plan` and `backends` (baselines and concurrent runs on SLURM, the emulated cluster or local processes),
`stats` (sigma and its confidence interval), `sigma_report` (plots, Markdown, TensorBoard).
"""
