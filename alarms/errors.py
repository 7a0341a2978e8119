"""Errors of the alarms package."""


class AlarmError(Exception):
    """Raised for any failure inside the alarms package (root of its errors)."""


class InvalidLimit(AlarmError, ValueError):
    """Raised when a memory watermark or disk free limit cannot be parsed or is out of range."""


class ProbeError(AlarmError):
    """Raised when a memory or disk reading fails; the watchdog logs it and raises no alarm."""
