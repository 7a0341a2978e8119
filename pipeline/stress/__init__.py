"""``creditflow stress``: named stress scenarios, each ending in one verdict line.

``catalogue`` holds the scenarios (name, description, what RabbitMQ 3.x would
do) and their verdicts as pure functions of the figures a run measured;
``scenarios`` runs them with real processes; ``command`` is the command line.
"""

from __future__ import annotations


class StressError(Exception):
    """Raised when a stress scenario cannot be run at all (root of this package's errors)."""


class ScenarioUnavailable(StressError):
    """Raised when a scenario cannot run on this machine (a client library it drives is missing); it is skipped."""
