"""What the scripts that run creditflow beside a private RabbitMQ node share: a free port, and
``scripts/bench_vs_rabbitmq`` (which starts the node and a creditflow broker) loaded as a module."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import socket

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_module():
    """``scripts/bench_vs_rabbitmq`` as a module: its ``RabbitMQ`` node, ``creditflow_serve``, ``stop_serve``."""
    loader = importlib.machinery.SourceFileLoader("bench_vs_rabbitmq", os.path.join(SCRIPTS, "bench_vs_rabbitmq"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
