"""PerfTest-shaped load: publisher and consumer processes speaking AMQP over loopback."""
