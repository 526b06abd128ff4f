"""Running on many hosts: `jax.distributed` start-up, the machine's topology resolved from the processes,
the local launcher and the emulated network testbed."""
