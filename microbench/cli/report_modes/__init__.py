"""microbench-report's modes over the results store, one module each (index, baseline, judge, history,
fleet); cli/report.py defines their flags and picks the mode."""
