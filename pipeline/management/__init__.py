"""The management API, health checks and Prometheus ``/metrics``, as RabbitMQ's management and
prometheus plugins serve them.

``views``       pure: the broker's ``status`` (what ``creditflow ctl status`` returns) and the time in,
                RabbitMQ-shaped JSON out; rates from successive samples (``RateBook``)
``metrics``     pure: the same status as Prometheus metric families (RabbitMQ's names, and
                ``creditflow_*`` for what RabbitMQ lacks)
``histogram``   pure: the store's fsync times as cumulative buckets (the supervisor keeps one)
``writes``      pure: each path's methods, and the write calls' checks and refusals as RabbitMQ answers
``server``      the shell: a process of its own, started and restarted by the supervisor; it asks the
                supervisor for ``status`` over the ctl socket, so a slow HTTP client never stalls the broker
"""
