"""JAX's start-up with the CUDA plugin installed on a host without an NVIDIA driver, made quiet.

The `gpu-compile` extra installs JAX's CUDA plugin on CPU machines. There, every `import jax` makes the
plugin's native code log "Could not find cuda drivers" (absl C++ logging straight to file descriptor 2,
which no environment variable silences), and backend start-up tries CUDA first and logs a traceback before
falling back to the CPU. So on such a host, and only there: the default platform becomes the CPU (a user's
JAX_PLATFORMS wins), and JAX's import and plugin discovery run with descriptor 2 captured, every line that is
not that known chatter written back. A host with a driver, or without the plugin, is untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile

CHATTER = ("cudart_stub.cc", "All log messages before absl::InitializeLog()", "cuda_plugin_extension is not found",
           "Could not find cuda drivers")


def nvidia_driver_present() -> bool:
  return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def plugin_installed() -> bool:
  return importlib.util.find_spec("jax_plugins") is not None and (
      importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


@contextlib.contextmanager
def filtered_stderr(chatter: tuple[str, ...] = CHATTER):
  """File descriptor 2 captured for the block; its lines other than the known `chatter` are written back."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
              if not any(c in line for c in chatter)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def start_quietly() -> None:
  """On a driverless host with the CUDA plugin: CPU as the default platform, JAX imported and its plugins
  discovered without the chatter. Call before anything imports jax."""
  if "jax" in sys.modules or nvidia_driver_present() or not plugin_installed():
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  with filtered_stderr():
    import jax  # pylint: disable=g-import-not-at-top,unused-import
    try:
      from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
      xla_bridge._discover_and_register_pjrt_plugins()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass  # discovery then happens, with its chatter, at the first backend start
