"""Extractor Celery worker: `python -m services.extractor.worker` (or `eyas worker --stage extract`). See eyas.tasks."""
from eyas.tasks import run_worker

if __name__ == "__main__":
    run_worker("extract")
