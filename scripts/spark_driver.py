"""creditflow as a spark-submit application: ``spark-submit [spark options] scripts/spark_driver.py
sweep GRID.toml --out SHARED_DIR`` (or ``report RUN_DIR``). spark-submit's --master and --conf
settings stand; the interpreter it runs must have creditflow installed."""

import sys

from pipeline.cli import main

sys.exit(main())
