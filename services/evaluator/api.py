"""Evaluator job API: `uvicorn services.evaluator.api:app` (or `eyas api --stage evaluate`). See eyas.api."""
from eyas.api import create_app

app = create_app("evaluate")
