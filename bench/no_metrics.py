"""Bench only: a worker started with `-I bench.no_metrics` counts nothing and
stamps nothing (courier without its metrics), for bench_metrics' baseline."""

from celery.signals import before_task_publish

import tasks.metrics
import workers.celery_app

tasks.metrics._ON = False
before_task_publish.disconnect(workers.celery_app._stamp)
