"""Sweeps: multirun jobs, their CPU shares, hyper-parameter search, a job's SuperLink.

The experiment pipeline (:mod:`..server`) runs one experiment; a sweep runs it
once per job of a Hydra multirun, on one machine, side by side, on SLURM or on
Ray, and summarises the jobs.
"""
