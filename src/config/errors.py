"""The one exception for bad inputs: every layer raises it, the entry points print it as one line."""


class ConfigError(ValueError):
    """A bad input. The message is one line that says what to change."""
