"""What runs inside the broker's processes: the stage shells and the pure cores they feed.

The publish flow is reader -> channel -> queue -> store, the deliver/ack flow queue -> reader:

- shells, one per stage: ``reader`` (socket, AMQP connection, ``throttle``), ``channel``, ``queue``,
  ``store``, all built on ``stage`` (the loop, the links' rings) and run alone or many to a process
  by ``host``; ``supervisor`` starts, links, watches and restarts them; ``wire`` is the ring records'
  layout.
- pure cores: ``routing`` (exchanges, bindings), ``confirms`` (publisher confirms, tx), ``backlog``
  (deliver_or_enqueue: consumers, prefetch, unacked, TTL, max-length, dead-lettering), ``paging``,
  ``limiter``, ``consumer_bias``, ``lifecycle`` (what the supervisor does when a stage ends),
  ``definitions`` (exchanges, queues, bindings, reply codes), ``names`` (AMQP names to file names).

Nothing here imports the tools on top (CLI, bench, load generator, analytics).
"""
