"""The broker's ``status`` as Prometheus metrics: RabbitMQ 3.10's names where it has them, ``creditflow_*``
for what it lacks. Pure: ``families(status)`` builds every family from one sample; ``StatusCollector``
is the prometheus_client Collector that takes one sample per scrape.

Per-queue metrics carry ``vhost`` and ``queue`` labels, as RabbitMQ's ``/metrics/per-object`` (or
``prometheus.return_per_object_metrics = true``) shows them; the node-wide ones have no label, as
in its aggregated ``/metrics``. What creditflow adds:

==========================================  ===========================================================
``creditflow_process_state``                {kind,name,state}: 1 for each process's current state
                                            (running, flow, blocking, blocked, closing), 0 for the others
``creditflow_flow_seconds_total``           {kind,name}: seconds the process has shown ``flow``
``creditflow_blocked_seconds_total``        {kind,name}: seconds it has been credit-blocked
``creditflow_link_in_flight``               {sender,receiver}: credit-bearing records in the link's ring,
                                            written and not yet read (the ring's occupancy)
``creditflow_link_credit``                  {sender,receiver}: credit the sender has left (flow links)
``creditflow_link_sent_total``              {sender,receiver}: messages sent over the link
``creditflow_store_fsync_seconds``          histogram of the message store's fsyncs
==========================================  ===========================================================
"""

from __future__ import annotations

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    UnknownMetricFamily)
from prometheus_client.registry import Collector

from pipeline.management.views import VHOST, Views
from pipeline.telemetry.schema import ReaderStats

PROCESS_STATES = ("running", "flow", "blocking", "blocked", "closing")
KINDS_SHOWN = ("reader", "channel", "queue", "store")        # processes with a credit-flow state


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def families(status: dict) -> list:
    views = Views(status)
    node = views.nodes()[0]
    alarms = views.alarms()
    totals = views.totals()
    queues = views.queues()
    out = []

    identity = UnknownMetricFamily("rabbitmq_identity_info", "RabbitMQ node & cluster identity info",
                                   labels=["rabbitmq_node", "rabbitmq_cluster", "rabbitmq_cluster_permanent_id"])
    identity.add_metric([views.node, views.node, f"creditflow-cluster-id-{views.node}"], 1)
    out.append(identity)
    for name, help_text, on in (
            ("rabbitmq_alarms_memory_used_watermark", "is 1 if VM memory watermark alarm is in effect",
             "memory" in alarms),
            ("rabbitmq_alarms_free_disk_space_watermark", "is 1 if free disk space watermark alarm is in effect",
             "disk" in alarms),
            ("rabbitmq_alarms_file_descriptor_limit", "is 1 if file descriptor limit alarm is in effect",
             "file_descriptor_limit" in alarms)):
        out.append(UnknownMetricFamily(name, help_text, value=1 if on else 0))
    for name, help_text, value in (
            ("rabbitmq_resident_memory_limit_bytes", "Memory high watermark in bytes", node["mem_limit"]),
            ("rabbitmq_process_resident_memory_bytes", "Memory used in bytes", node["mem_used"]),
            ("rabbitmq_disk_space_available_bytes", "Disk space available in bytes", node["disk_free"]),
            ("rabbitmq_disk_space_available_limit_bytes", "Free disk space low watermark in bytes",
             node["disk_free_limit"]),
            ("rabbitmq_process_open_fds", "Open file descriptors", node["fd_used"]),
            ("rabbitmq_process_max_fds", "Open file descriptors limit", node["fd_total"]),
            ("rabbitmq_connections", "Connections currently open", len(views.live("reader"))),
            ("rabbitmq_channels", "Channels currently open", len(views.live("channel"))),
            ("rabbitmq_queues", "Queues available", len(queues)),
            ("rabbitmq_consumers", "Consumers currently connected", sum(q["consumers"] for q in queues))):
        out.append(GaugeMetricFamily(name, help_text, value=_num(value)))

    amqp = ["protocol"]
    for name, help_text, value in (
            ("rabbitmq_global_messages_received", "Total number of messages received from publishers",
             totals["publish"]),
            ("rabbitmq_global_messages_confirmed", "Total number of messages confirmed to publishers",
             totals["confirm"]),
            ("rabbitmq_global_messages_routed", "Total number of messages routed to queues or streams",
             totals["publish"] - totals["return_unroutable"] - totals["drop_unroutable"]),
            ("rabbitmq_global_messages_unroutable_returned", "Total number of messages published as mandatory "
             "into an exchange and returned to the publisher as unroutable", totals["return_unroutable"]),
            ("rabbitmq_global_messages_unroutable_dropped", "Total number of messages published as non-mandatory "
             "into an exchange and dropped as unroutable", totals["drop_unroutable"])):
        family = CounterMetricFamily(name, help_text, labels=amqp)
        family.add_metric(["amqp091"], max(0, value))
        out.append(family)
    octets = views.connection_octets()
    for name, help_text, key in (
            ("rabbitmq_connection_incoming_bytes", "Total number of bytes received on a connection", "recv_oct"),
            ("rabbitmq_connection_outgoing_bytes", "Total number of bytes sent on a connection", "send_oct")):
        out.append(CounterMetricFamily(name, help_text, value=octets[key]))
    channels = views.channels()
    for name, help_text, key in (
            ("rabbitmq_channel_consumers", "Consumers on a channel", "consumer_count"),
            ("rabbitmq_channel_messages_unacked", "Delivered but not yet acknowledged messages",
             "messages_unacknowledged"),
            ("rabbitmq_channel_messages_unconfirmed", "Published but not yet confirmed messages",
             "messages_unconfirmed")):
        out.append(GaugeMetricFamily(name, help_text, value=sum(c[key] for c in channels)))
    by_queue_type = ["protocol", "queue_type"]
    for name, help_text, value in (
            ("rabbitmq_global_messages_delivered", "Total number of messages delivered to consumers",
             totals["deliver_get"]),
            ("rabbitmq_global_messages_redelivered", "Total number of messages redelivered to consumers",
             totals["redeliver"]),
            ("rabbitmq_global_messages_acknowledged", "Total number of messages acknowledged by consumers",
             totals["ack"])):
        family = CounterMetricFamily(name, help_text, labels=by_queue_type)
        family.add_metric(["amqp091", "rabbit_classic_queue"], value)
        out.append(family)

    per_queue = ["vhost", "queue"]
    gauges = {name: GaugeMetricFamily(name, help_text, labels=per_queue) for name, help_text in (
        ("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages - total queue depth"),
        ("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers"),
        ("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet acknowledged"),
        ("rabbitmq_queue_consumers", "Consumers on a queue"),
        ("rabbitmq_queue_messages_ready_bytes", "Size in bytes of ready messages"),
        ("rabbitmq_queue_messages_paged_out", "Messages paged out to disk"))}
    published = CounterMetricFamily("rabbitmq_queue_messages_published", "Total number of messages published "
                                    "to queues", labels=per_queue)
    for q in queues:
        labels = [VHOST, q["name"]]
        for name, key in (("rabbitmq_queue_messages", "messages"), ("rabbitmq_queue_messages_ready", "messages_ready"),
                          ("rabbitmq_queue_messages_unacked", "messages_unacknowledged"),
                          ("rabbitmq_queue_consumers", "consumers"),
                          ("rabbitmq_queue_messages_ready_bytes", "message_bytes_ready"),
                          ("rabbitmq_queue_messages_paged_out", "messages_paged_out")):
            gauges[name].add_metric(labels, q[key])
        published.add_metric(labels, (q.get("message_stats") or {}).get("publish", 0))
    out += [*gauges.values(), published]

    state = GaugeMetricFamily("creditflow_process_state", "1 for the state each broker process is in now "
                              "(RabbitMQ's running, flow, blocking, blocked, closing)", labels=["kind", "name", "state"])
    flow = CounterMetricFamily("creditflow_flow_seconds", "Seconds the process has shown flow (credit-blocked, "
                               "or blocked less than 1 s ago)", labels=["kind", "name"])
    blocked = CounterMetricFamily("creditflow_blocked_seconds", "Seconds the process has been credit-blocked",
                                  labels=["kind", "name"])
    for kind in KINDS_SHOWN:
        for name, st in views.live(kind):
            now = st.conn_state if isinstance(st, ReaderStats) else st.state
            for s in PROCESS_STATES:
                if s in ("blocking", "blocked", "closing") and kind != "reader":
                    continue
                state.add_metric([kind, name, s], 1 if now == s else 0)
            extra = views.process_extra(name)
            flow.add_metric([kind, name], extra["flow_seconds"])
            blocked.add_metric([kind, name], extra["blocked_seconds"])
    out += [state, flow, blocked]

    link_labels = ["sender", "receiver"]
    in_flight = GaugeMetricFamily("creditflow_link_in_flight", "Records in the link's ring: written by the "
                                  "sender, not yet read by the receiver", labels=link_labels)
    credit = GaugeMetricFamily("creditflow_link_credit", "Credit the sender has left towards the receiver "
                               "(credit-flow links only)", labels=link_labels)
    sent = CounterMetricFamily("creditflow_link_sent", "Messages sent over the link", labels=link_labels)
    for link in views.links_view():
        labels = [link["sender"], link["receiver"]]
        in_flight.add_metric(labels, link["in_flight"])
        sent.add_metric(labels, link["sent"])
        if link["credit"] is not None:
            credit.add_metric(labels, link["credit"])
    out += [in_flight, credit, sent]

    fsync = status.get("fsync_histogram")
    if fsync:
        hist = HistogramMetricFamily("creditflow_store_fsync_seconds", "Duration of the message store's fsyncs")
        hist.add_metric([], [(("+Inf" if b == "+Inf" else repr(float(b))), n) for b, n in fsync["buckets"]],
                        sum_value=fsync["sum_s"])
        out.append(hist)
    return out


class StatusCollector(Collector):
    """A Collector over ``sample()`` (a function returning one status): one sample per scrape."""

    def __init__(self, sample) -> None:
        self.sample = sample

    def collect(self):
        yield from families(self.sample())
