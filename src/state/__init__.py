"""What survives a process: checkpoints, the resume rules, stop signals and the run lock."""
