"""The command lines: one module per console script, flags and argument checks only (the work is in the
packages below them), plus the absl runner they share and the cluster flags every command takes."""
