"""Training throughput of Flax models under parallel strategies: the request and its mesh (`config`), the
run loop and its summary (`loop`), MFU peaks (`flops_peaks`) and the step's communication fingerprint
(`comm_fingerprint`)."""

from microbench.output.train_log import METRICS_FILE
from microbench.train.config import ConfigError, Plan, TrainConfig, check_request, cpu_devices_wanted, plan
from microbench.train.loop import Result, format_table, run

__all__ = ["METRICS_FILE", "ConfigError", "Plan", "Result", "TrainConfig", "check_request", "cpu_devices_wanted",
           "format_table", "plan", "run"]
