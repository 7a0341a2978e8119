"""Celery against the broker: a real ``celery worker`` runs tasks that the test sends.

The worker is Celery's own command with its defaults (prefork pool, mingle,
gossip, heartbeats, remote control over ``celery.pidbox``, events on
``celeryev``), so it uses what a production worker uses: durable task queues,
fanout exchanges, queues with ``x-expires`` and ``x-message-ttl``, prefetch,
acks, and the ``rpc://`` result backend, which replies over the default
exchange to the caller's own queue. The same test runs against RabbitMQ
itself (see ``tests/amqp_targets.py``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import _started, kill_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(90)]

TASKS = textwrap.dedent('''
    import os
    from celery import Celery

    app = Celery("{module}", broker=os.environ["CREDITFLOW_CELERY_BROKER"], backend="rpc://")
    app.conf.update(task_default_queue="{queue}", broker_connection_retry_on_startup=True,
                    worker_hijack_root_logger=False)


    @app.task
    def multiply(x, y):
        return x * y


    @app.task
    def fail(reason):
        raise ValueError(reason)
''')


@pytest.fixture
def celery_tasks(amqp, tmp_path):
    """The tasks module, imported here as a client, and a worker serving it until the test ends."""
    module = f"cftasks_{amqp.tag}"
    (tmp_path / f"{module}.py").write_text(TASKS.format(module=module, queue=amqp.name("celery")))
    env = dict(os.environ, CREDITFLOW_CELERY_BROKER=amqp.url, PYTHONPATH=str(tmp_path))
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", module, "worker", "--loglevel=INFO",
                               "--concurrency=1", "--hostname", f"{module}@localhost"],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _started.append(worker)
    os.environ["CREDITFLOW_CELERY_BROKER"] = amqp.url
    sys.path.insert(0, str(tmp_path))
    try:
        tasks = importlib.import_module(module)
        yield tasks, worker, tmp_path / "worker.log"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)
        os.environ.pop("CREDITFLOW_CELERY_BROKER", None)
        kill_group(worker, grace_s=0.5)      # its warm shutdown waits out the grace; nothing is asked of it now
        log.close()


def test_a_celery_worker_runs_tasks_and_returns_their_results(celery_tasks):
    tasks, worker, log = celery_tasks
    try:
        assert tasks.multiply.delay(6, 7).get(timeout=30) == 42
        results = [tasks.multiply.delay(i, i) for i in range(5)]
        assert [r.get(timeout=10) for r in results] == [0, 1, 4, 9, 16]
        with pytest.raises(ValueError, match="^refused$"):
            tasks.fail.delay("refused").get(timeout=10)
        assert tasks.app.control.ping(timeout=2.0) == [{f"{tasks.__name__}@localhost": {"ok": "pong"}}]
    except BaseException:
        print(log.read_text()[-6000:])
        raise
    finally:
        tasks.app.close()
    assert worker.poll() is None, log.read_text()[-6000:]
