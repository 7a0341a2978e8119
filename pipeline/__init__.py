"""The broker pipeline (reader, channel, queue, store), its supervisor, load generator and CLI.

Wings: ``broker`` (what runs in the broker's processes), ``storage`` (segment files and the queue
journal), ``amqp`` (AMQP 0-9-1 connection and frames), ``telemetry`` (the statistics schema and its
recorder), ``management`` (the HTTP API, /metrics, the live page), ``analytics`` (the Spark report),
``loadgen`` and ``stress`` (clients), and the commands on top (``cli``, ``bench``, ``demo``, ``view``,
``sweep``, ``runner``).
"""
