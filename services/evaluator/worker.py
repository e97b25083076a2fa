"""Evaluator Celery worker: `python -m services.evaluator.worker` (or `eyas worker --stage evaluate`). See eyas.tasks."""
from eyas.tasks import run_worker

if __name__ == "__main__":
    run_worker("evaluate")
