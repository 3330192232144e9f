"""Real jobs: one module per job, each with run(scale) -> checksum; child.py runs
one in this process, and `python3 -m bench.jobs` (__main__.py) runs them all under
each allocator."""
