"""Compiling for a GPU cluster without one.

`compile_only` turns a GPU kind (`microbench.fabric.gpu_kinds`: the kinds' facts as data) and a
`racks x nodes x gpus` shape into XLA:GPU compile-only devices (JAX's deviceless ahead-of-time topology),
whose programs can be compiled and read but never run. `quiet_start` keeps JAX's start-up quiet on a host
that has the CUDA plugin but no driver.
"""
