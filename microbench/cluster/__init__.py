"""Running on many hosts: `jax.distributed` start-up, the machine's topology resolved from the processes,
the local launcher, the emulated network testbed, and the watchdog that ends a hung process."""
