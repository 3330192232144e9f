"""Allocation profiles, one module per concern:

  recording.py      recording: DATAMEM_PROFILE, the pass-through policy, `profile`'s run
  dmprof.py         the .dmprof file format and the per-file reader
  read.py           load(DIR): every file streamed into one Profile of sums
  report.py         `report`'s summary, text, JSON and HTML
  flame.py          flame graphs and folded stacks
  suggest.py        a policy from a profile; suggest_spill.py its spill arena
  tune.py           `tune`: the job measured under each candidate policy
"""
