"""Prometheus numbers of the job API: job counts by stage and state, and live numbers of running jobs."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orchestration.jobs import TERMINAL, JobStore


class JobCollector:
    """Job counts by stage and state, read from the job store at scrape time: the same numbers whichever API
    replica is scraped, and including the jobs that workers ran and `then` pipelines submitted."""

    def __init__(self, jobs: JobStore):
        self.jobs = jobs

    def collect(self):
        counts = self.jobs.counts()
        submitted = CounterMetricFamily("eyas_jobs_submitted", "jobs accepted, by stage", labels=["stage"])
        ended = {s: CounterMetricFamily(f"eyas_jobs_{s}", f"jobs that ended {s}, by stage", labels=["stage"])
                 for s in sorted(TERMINAL)}
        active = GaugeMetricFamily("eyas_jobs_active", "jobs queued or running", labels=["stage", "state"])
        for stage in sorted({st for st, _ in counts}):
            submitted.add_metric([stage], sum(n for (st, _), n in counts.items() if st == stage))
            for state, family in ended.items():
                family.add_metric([stage], counts.get((stage, state), 0))
            for state in ("queued", "running"):
                active.add_metric([stage, state], counts.get((stage, state), 0))
        # live numbers of running jobs (generator: concurrency, in_flight, completed, failed, retried, tokens_per_s)
        live = GaugeMetricFamily("eyas_job_metric", "numeric metrics of running jobs", labels=["stage", "job", "name"])
        for job in self.jobs.list(state="running", limit=100):
            for name, value in job.metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    live.add_metric([job.stage, job.id, name], float(value))
        yield submitted
        yield from ended.values()
        yield active
        yield live
