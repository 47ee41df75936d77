"""What a run and a sweep report: results, loggers, hardware efficiency and the seed-averaged table."""
