"""AMQP 0-9-1: a fast codec for the per-message frames and a sans-IO server connection."""
