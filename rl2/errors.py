"""The errors a user's input is reported as: each message says what to fix."""


class ConfigError(ValueError):
    """A bad command-line argument or config file; the message says what to fix."""


class DataError(ValueError):
    """Unreadable or invalid training data; the message names the file and, where it can, the row and field."""
