"""The one exception type for mistakes a user can fix."""


class UsageError(Exception):
    """Bad input (a flag, a path, the launch environment): reported as one line, never a traceback."""
