"""TensorBoard event files written with the `tensorboard` package alone (no TensorFlow).

`flax.metrics.tensorboard` and CLU import TensorFlow; this writes the same protos that torch's
SummaryWriter writes, through tensorboard's own EventFileWriter.
"""

from __future__ import annotations

import time

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class TensorBoardLog:
  """Scalars and text into one event file under `logdir`; flushed on every write so nothing is lost."""

  def __init__(self, logdir: str, flush_each: bool = True):
    self._writer = EventFileWriter(logdir)
    self._flush_each = flush_each

  def _add(self, summary: summary_pb2.Summary, step: int) -> None:
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    if self._flush_each:
      self._writer.flush()

  def scalar(self, tag: str, value: float, step: int) -> None:
    self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))]), step)

  def text(self, tag: str, text: str, step: int = 0) -> None:
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[text.encode()],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
    self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)]), step)

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
