"""Trainer job API: `uvicorn services.trainer.api:app` (or `eyas api --stage train`). See eyas.api."""
from eyas.api import create_app

app = create_app("train")
