"""`python -m microbench` is the `microbench` command."""

from microbench.cli.bench import run

if __name__ == "__main__":
  run()
