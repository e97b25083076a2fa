"""Generator Celery worker: `python -m services.generator.worker` (or `eyas worker --stage generate`). See eyas.tasks."""
from eyas.tasks import run_worker

if __name__ == "__main__":
    run_worker("generate")
