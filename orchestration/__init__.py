"""The orchestration above the stages: job records and their state machine, submit/execute, the stage registry,
runtimes (embedded and service), the Celery app and tasks, the HTTP API, the CLI and `eyas run`.

It imports the stages (services.*) and the contract library (eyas); neither imports it."""
