"""Extractor job API: `uvicorn services.extractor.api:app` (or `eyas api --stage extract`). See eyas.api."""
from eyas.api import create_app

app = create_app("extract")
