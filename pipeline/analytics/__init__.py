"""The Spark data pipeline behind ``creditflow report``.

Only this package imports pyspark; no broker process loads it. Entry point:
:func:`pipeline.analytics.report.build_report`. Import it from its module so
that importing this package stays cheap.
"""
