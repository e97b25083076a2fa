"""The lines the vLLM capture engine (services.extractor.vllm_server) and its parent (services.extractor.vllm_backend)
exchange: tags that start the engine's stdout lines. What each carries is in vllm_server's docstring."""
READY = "EYAS-VLLM-READY"
UNSUPPORTED = "EYAS-VLLM-UNSUPPORTED "  # + why (the engine exits)
NEXT = "EYAS-VLLM-NEXT "  # + the object it took
PROGRESS = "EYAS-VLLM-PROGRESS "  # + tokens
UPLOADED = "EYAS-VLLM-UPLOADED "  # + {"obj", "entry"}
DONE = "EYAS-VLLM-DONE"
TAGS = (READY, UNSUPPORTED, NEXT, PROGRESS, UPLOADED, DONE)
