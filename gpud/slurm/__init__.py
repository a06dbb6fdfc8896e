"""Slurm's view of this node's GPUs: the gres.conf gpud writes from what it knows."""
