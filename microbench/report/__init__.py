"""Reading finished runs: alpha-beta fits, summary and ratio tables, plots and the Markdown report."""
