"""One run from the command line to metrics.json: plan, launch, the training loop and sweeps."""
