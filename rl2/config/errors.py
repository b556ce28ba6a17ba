"""The error every config problem is reported as."""


class ConfigError(ValueError):
    """A bad command-line argument or config file; the message says what to fix."""
