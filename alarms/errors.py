"""Errors of the alarms package: one root, and what each one means."""


class AlarmError(Exception):
    """Raised when anything in the alarms package fails (root of its errors)."""


class InvalidLimit(AlarmError, ValueError):
    """Raised when a memory watermark or disk free limit cannot be parsed or is out of range."""


class ProbeError(AlarmError):
    """Raised when a memory or disk reading fails; the watchdog logs it and raises no alarm."""


class UnknownSource(AlarmError, ValueError):
    """Raised when an alarm source is neither 'memory' nor 'disk'."""


class UnknownStrategy(AlarmError, ValueError):
    """Raised when a memory strategy is neither 'rss' nor 'system'."""
