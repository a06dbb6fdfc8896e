"""Slurm integration: gres.conf from gpud, and the health program that drains and resumes nodes."""
