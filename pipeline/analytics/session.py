"""The Spark session the report runs in.

``local[*]`` unless a master URL is given, or a Spark Connect client when a
``remote`` URL is. Start-up is kept cheap: no web UI,
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


def new_session(master: str | None = None, remote: str | None = None) -> SparkSession:
    """Start (or join) a Spark session configured for small telemetry inputs.

    ``remote`` is a Spark Connect URL (``sc://host:15002``; ``local[N]`` starts a
    Connect server of its own): the session is then a Connect client, which
    takes only SQL settings from here."""
    # Workers must run the same interpreter as the driver (the project venv).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if remote:
        return (SparkSession.builder.remote(remote).appName(APP_NAME)
                .config("spark.sql.session.timeZone", "UTC")
                .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
                .getOrCreate())
    builder = SparkSession.builder
    if master or not under_spark_submit():
        builder = builder.master(master or DEFAULT_MASTER)   # else spark-submit's --master stands
    session = (builder
               .appName(APP_NAME)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(SHUFFLE_PARTITIONS))
               .config("spark.driver.memory", DRIVER_MEMORY)
               .config("spark.sql.session.timeZone", "UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def under_spark_submit() -> bool:
    """Whether this driver was launched by spark-submit (its JVM is already up and configured)."""
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT"))


@contextlib.contextmanager
def spark_session(master: str | None = None, remote: str | None = None) -> Iterator[SparkSession]:
    """The active classic session if there is one (and no Connect URL is given), else a new one
    stopped on exit."""
    if not remote:
        active = SparkSession.getActiveSession()
        if active is None and SparkContext._active_spark_context is not None:
            active = SparkSession.builder.getOrCreate()   # started in another thread; not ours to stop
        if active is not None:
            yield active
            return
    session = new_session(master, remote)
    try:
        yield session
    finally:
        session.stop()


def describe(spark: SparkSession) -> str:
    """Where a session runs, for log lines: its master, or its Connect server."""
    try:
        return spark.conf.get("spark.master")
    except Exception:
        return getattr(getattr(spark, "client", None), "host", None) or "Spark Connect"
