"""``python -m pipeline.stress ARGS``: ``creditflow stress ARGS``."""

import sys

from pipeline.stress.command import main

sys.exit(main())
