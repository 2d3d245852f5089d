"""Benchmarks: nonstop against its peers, in the same run, on the same job."""
