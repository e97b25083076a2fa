"""The job API, one shape for every stage's service (`orchestration.api.app.create_app(stage)`)."""
