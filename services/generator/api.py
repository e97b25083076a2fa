"""Generator job API: `uvicorn services.generator.api:app` (or `eyas api --stage generate`). See eyas.api."""
from eyas.api import create_app

app = create_app("generate")
