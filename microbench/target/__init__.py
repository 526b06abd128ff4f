"""GPU kinds as data, and compiling for a GPU cluster without one.

`gpu_kinds` reads the package's `specs/*.toml`: one file per GPU kind with its datasheet facts (NVLink
generation, dense peaks for MFU, and for compile targets the device description XLA:GPU's compiler needs),
each naming its sources. The link peaks and MFU peaks the toolkit reports come from here, one place.
`compile_only` turns a kind and a `racks x nodes x gpus` shape into XLA:GPU compile-only devices (JAX's
deviceless ahead-of-time topology), whose programs can be compiled and read but never run.
"""
