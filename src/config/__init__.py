"""The command line and the config: each option's type and range, the run's layout, the one ConfigError."""
