"""The Spark session the report runs in.

``local[*]`` unless a master URL is given. Start-up is kept cheap: no web UI,
four shuffle partitions (the inputs are a few megabytes), a 1 GiB driver.
If a session is already active in this interpreter (a notebook, a test
fixture, ``creditflow sweep``) it is reused and left running; a session this
module starts is stopped when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from pyspark import SparkContext
from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
SHUFFLE_PARTITIONS = 4
DRIVER_MEMORY = "1g"
APP_NAME = "creditflow-report"


def new_session(master: str | None = None) -> SparkSession:
    """Start (or join) a Spark session configured for small telemetry inputs."""
    # Workers must run the same interpreter as the driver (the project venv).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (SparkSession.builder
               .master(master or DEFAULT_MASTER)
               .appName(APP_NAME)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
               .config("spark.driver.memory", DRIVER_MEMORY)
               .config("spark.sql.session.timeZone", "UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


@contextlib.contextmanager
def spark_session(master: str | None = None) -> Iterator[SparkSession]:
    """The active session if there is one, else a new one stopped on exit."""
    active = SparkSession.getActiveSession()
    if active is None and SparkContext._active_spark_context is not None:
        active = SparkSession.builder.getOrCreate()   # started in another thread; not ours to stop
    if active is not None:
        yield active
        return
    session = new_session(master)
    try:
        yield session
    finally:
        session.stop()
