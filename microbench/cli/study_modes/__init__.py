"""`microbench-study`'s modes, one module each (microbench/cli/study.py dispatches): a mode's module defines its
own flags at import, so only the mode that runs has its flags defined, and each flag name means one thing."""
