"""ddplab: compare single-device, DataParallel, DDP and FSDP training under one Hydra config."""

from src.run.resolvers import register_resolvers

register_resolvers()  # the run-directory resolvers must exist wherever a config is composed (SLURM nodes too)
