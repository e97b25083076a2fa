"""Names that only frameworks use, which vulture cannot see being used (`make lint` passes this file to vulture).

Only entry points belong here; a name nothing calls is dead code and gets deleted, not listed. This file is
parsed, never run.
"""
from types import SimpleNamespace

_ = SimpleNamespace()
_ = (
    # FastAPI: routes, middleware and exception handlers registered by decorators in orchestration.api (app.py, routes.py)
    _.submit_job, _.read_job, _.list_jobs, _.cancel_job, _.healthz, _.readyz, _.metrics,
    _.time_requests, _.invalid_request,
    _.collect,  # prometheus_client calls a registered collector's collect()
    _.run_job,  # the Celery task (orchestration.tasks), called by the worker by its registered name
    _.model_config,  # pydantic / pydantic-settings class configuration
    _.pytestmark,  # pytest module-level marks
)
