"""Real jobs for bench/jobs.py: one module per job, each with run(scale) -> checksum."""
