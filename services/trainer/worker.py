"""Trainer Celery worker: `python -m services.trainer.worker` (or `eyas worker --stage train`). See eyas.tasks."""
from eyas.tasks import run_worker

if __name__ == "__main__":
    run_worker("train")
