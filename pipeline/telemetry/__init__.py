"""Telemetry: what a broker run leaves behind for analysis.

* :mod:`.schema`   the statistics of every stage as frozen dataclasses: THE schema
                   (stdlib only; every broker process imports it);
* :mod:`.events`   the data of the supervisor's events as a frozen dataclass (stdlib only);
* :mod:`.recorder` the supervisor's ``Recorder``: JSON lines while the broker runs;
* :mod:`.parquet`  the Arrow schemas derived from ``schema`` and ``events``, and the JSONL -> Parquet
                   compaction (imports pyarrow: only after the stages stopped, or outside the broker).
"""

from pipeline.telemetry.recorder import FLUSH_INTERVAL_S, STATS_ROWS_PER_S, Recorder

__all__ = ["FLUSH_INTERVAL_S", "STATS_ROWS_PER_S", "Recorder"]
