"""The library's contract with its scripts (scripts/*.py): how a script starts, logs and fails
(script.py: one line per user mistake, exit status 2), the flags several scripts share and their
checks (flags.py), and whether a training run starts, resumes or is done (runs.py). Importing it
loads no JAX, so `--help` and flag mistakes answer at once."""
