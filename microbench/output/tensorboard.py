"""TensorBoard event files written with the `tensorboard` package alone (no TensorFlow).

`flax.metrics.tensorboard` and CLU import TensorFlow, and so do tensorboard's own `summary.pb` helpers for
custom scalars and hparams; this writes the same protos (as torch's SummaryWriter does) through
tensorboard's EventFileWriter and the plugins' metadata modules, which need no TensorFlow.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as cs_metadata
from tensorboard.plugins.hparams import api_pb2
from tensorboard.plugins.hparams import metadata as hp_metadata
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

# One chart: (title, tag regexes); one category: (title, charts).
Chart = tuple[str, Sequence[str]]
Category = tuple[str, Sequence[Chart]]


def _string_tensor(data: bytes) -> tensor_pb2.TensorProto:
  return tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[data],
                                tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))


def _hparams_value(tag: str, data: plugin_data_pb2.HParamsPluginData) -> summary_pb2.Summary.Value:
  # The hparams plugin reads only the metadata; the tensor is an empty placeholder as in its own writer.
  return summary_pb2.Summary.Value(tag=tag, metadata=hp_metadata.create_summary_metadata(data),
                                   tensor=tensor_pb2.TensorProto(dtype="DT_FLOAT", float_val=[0.0]))


class TensorBoardLog:
  """Scalars and text into one event file under `logdir`; flushed on every write so nothing is lost."""

  def __init__(self, logdir: str, flush_each: bool = True):
    self._writer = EventFileWriter(logdir)
    self._flush_each = flush_each
    self._described: set[str] = set()

  def _add(self, summary: summary_pb2.Summary, step: int) -> None:
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    if self._flush_each:
      self._writer.flush()

  def scalar(self, tag: str, value: float, step: int, description: str = "") -> None:
    """One point; a description (TensorBoard shows it by the chart) goes with the tag's first point only, the
    one TensorBoard reads."""
    v = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
    if description and tag not in self._described:
      self._described.add(tag)
      v.metadata.CopyFrom(summary_pb2.SummaryMetadata(
          summary_description=description,
          plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")))
    self._add(summary_pb2.Summary(value=[v]), step)

  def text(self, tag: str, text: str, step: int = 0) -> None:
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta,
                                                                   tensor=_string_tensor(text.encode()))]), step)

  def image(self, tag: str, png: bytes, width: int, height: int, step: int = 0) -> None:
    """A PNG for the Images tab."""
    img = summary_pb2.Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)
    self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, image=img)]), step)

  def custom_scalars(self, categories: Sequence[Category], step: int = 0) -> None:
    """The Custom Scalars tab's layout: categories of charts, each chart one line per tag matching its
    regexes. TensorBoard merges the layouts of all runs (categories and charts by title), each run's last one."""
    layout = layout_pb2.Layout(category=[
        layout_pb2.Category(title=title, chart=[
            layout_pb2.Chart(title=chart, multiline=layout_pb2.MultilineChartContent(tag=list(tags)))
            for chart, tags in charts]) for title, charts in categories])
    value = summary_pb2.Summary.Value(tag=cs_metadata.CONFIG_SUMMARY_TAG,
                                      metadata=cs_metadata.create_summary_metadata(),
                                      tensor=_string_tensor(layout.SerializeToString()))
    self._add(summary_pb2.Summary(value=[value]), step)

  def hparams_experiment(self, hparams: Mapping[str, str], metrics: Mapping[str, str],
                         lead: Sequence[str] = (), descriptions: Mapping[str, str] | None = None) -> None:
    """The HParams tab's columns: hyperparameter names with their type ('number', 'bool' or 'string') and metric
    tags with display names. Every run writes the same experiment, so whichever TensorBoard reads agrees.

    TensorBoard lists hyperparameters marked as differing first (then by name) and shows only the first
    few: `lead` names the ones a comparison is about, so they are the columns a reader sees. `descriptions`:
    metric tag -> what the column means (its display name can then be short)."""
    types = {"number": api_pb2.DATA_TYPE_FLOAT64, "bool": api_pb2.DATA_TYPE_BOOL, "string": api_pb2.DATA_TYPE_STRING}
    infos = [api_pb2.HParamInfo(name=name, type=types[kind], differs=name in lead) for name, kind in hparams.items()]
    metric_infos = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=name,
                                       description=(descriptions or {}).get(tag, ""))
                    for tag, name in metrics.items()]
    data = plugin_data_pb2.HParamsPluginData(experiment=api_pb2.Experiment(hparam_infos=infos,
                                                                           metric_infos=metric_infos))
    self._add(summary_pb2.Summary(value=[_hparams_value(hp_metadata.EXPERIMENT_TAG, data)]), 0)

  def hparams_session_start(self, hparams: Mapping[str, float | str | bool]) -> None:
    """This run's hyperparameter values (the run is one session of the HParams tab)."""
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, v in hparams.items():
      if isinstance(v, bool):
        info.hparams[name].bool_value = v
      elif isinstance(v, (int, float)):
        info.hparams[name].number_value = float(v)
      else:
        info.hparams[name].string_value = str(v)
    data = plugin_data_pb2.HParamsPluginData(session_start_info=info)
    self._add(summary_pb2.Summary(value=[_hparams_value(hp_metadata.SESSION_START_INFO_TAG, data)]), 0)

  def hparams_session_end(self, ok: bool = True) -> None:
    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS if ok else api_pb2.STATUS_FAILURE,
                                          end_time_secs=time.time())
    data = plugin_data_pb2.HParamsPluginData(session_end_info=info)
    self._add(summary_pb2.Summary(value=[_hparams_value(hp_metadata.SESSION_END_INFO_TAG, data)]), 0)

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
