"""Names that only frameworks use, which vulture cannot see being used (`make lint` passes this file to vulture,
at confidence 60, where it reports unused functions, methods and fields).

Only entry points, framework hooks and fields read by name belong here; a name nothing calls is dead code and gets
deleted, not listed. This file is parsed, never run.
"""
from types import SimpleNamespace

_ = SimpleNamespace()
_ = (
    # FastAPI: routes, middleware and exception handlers registered by decorators in orchestration.api
    # (app.py, routes.py)
    _.submit_job, _.read_job, _.list_jobs, _.cancel_job, _.healthz, _.readyz, _.metrics,
    _.time_requests, _.invalid_request,
    _.collect,  # prometheus_client calls a registered collector's collect()
    _.run_job,  # the Celery task (orchestration.tasks), called by the worker by its registered name
    _.model_config,  # pydantic / pydantic-settings class configuration
    _.pytestmark,  # pytest module-level marks
    _.start_plain_vllm_early, _.settle_started_vllm,  # autouse pytest fixtures (tests/conftest.py)
    _.should_exit,  # uvicorn.Server polls it to stop (tests/test_proxy.py serves apps in a thread)
    # pydantic validators, run by the model on validation (eyas.manifest, eyas.settings, eyas.stage, the specs)
    _._no_secret, _._comma_separated, _._json_numbers, _._has_source, _._one_fc_norm,
    _.http_error,  # FastAPI exception handler (orchestration.api.app)
    _.watch_status, _.watch_series, _.watch_plot,  # FastAPI routes (orchestration.api.loop)
    _._watch_settings, _._refresh_settings,  # pydantic validators (orchestration.loop.settings)
    _.last_refresh,  # a response model's field, set by name (orchestration.api.loop.WatchView)
    _.assist_job,  # the generator's helper Celery task (orchestration.tasks), called by its registered name
    _._start_sweep,  # Celery worker_ready signal receiver (orchestration.tasks.run_worker)
    # vLLM KV-connector hooks: vLLM loads EyasCaptureConnector by name (services.extractor.vllm_server) and calls them
    _.EyasCaptureConnector, _.get_num_new_matched_tokens, _.update_state_after_alloc, _.build_connector_meta,
    _.request_finished_all_groups, _.register_kv_caches, _.start_load_kv, _.wait_for_layer_load, _.save_kv_layer,
    _.wait_for_save, _.get_required_kvcache_layout,
    _.padding_side, _.pre_tokenizer,  # attributes transformers / tokenizers read from the objects we set them on
    _.do_POST, _.do_GET, _.log_message,  # http.server request-handler hooks (tests/test_hostile.py)
    # fields read by name: Layout's through eyas.layout._CHECKED, diagnose.Variant's as dict rows
    _.target_config_hash, _.convention, _.layout_version, _.fix, _.engine_fault,
    # the evaluation report's fields (services/evaluator/model.py), serialized into report.json by pydantic
    _.per_prompt, _.skipped, _.logit, _.near_tie, _.greedy_mismatches, _.speculative_tok_s,
    _.matches_in_process_greedy, _.outputs_equal, _.plain_step_s, _.pays, _.predicted_speedup, _.measured_speedup,
    _.relative_error, _.measured_end_to_end_speedup, _.baseline_tok_s, _.tau_in_process, _.tau_vllm, _.target_s,
    _.drafter_s, _.tau_per_k, _.break_even_concurrency, _.tau_needed, _.per_position_acceptance_per_k,
    _.live_endpoints, _.serve_with, _.acceptance_gap, _.training, _.drafts_per_k, _.step_noise, _.breaks_even,
    _.accepted_per_output_token, _.drafter_tau, _.predicted_decision, _.drafter_s_in_process, _.spec_step_s,
    _.spec_tokens_per_step, _.spec_step_tau,
)
