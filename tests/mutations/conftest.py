# The mutation check is a script (python tests/mutations/run.py), not tests:
# keep pytest (and its --doctest-modules) out of this directory.
collect_ignore_glob = ["*.py"]
