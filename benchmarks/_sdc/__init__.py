"""Pieces of the SDC benchmark (``python -m benchmarks.sdc_coverage``): the trials, one rank's job, the tally, the
rendering."""
