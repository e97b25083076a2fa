"""The operator's quotas (orchestration.settings: EYAS_MAX_JOB_*, EYAS_ALLOW_IN_PROCESS_GENERATION): orchestration
policy, of which the stages know nothing.

`check_quotas` judges a parsed spec at submit (orchestration.execution.validate_spec: the job and each `then`
entry), from what the spec states; a quantity it cannot state (a prompt file's length, a conversation's turns)
must then be bounded by the field that does (limit, max_turns), or the job is refused. A refusal names the field,
its value and the cap's variable. The wall-time cap (max_job_minutes) is the run's: orchestration.execution.execute
stops a job past it (`wall_time_error`).
"""
from __future__ import annotations

from typing import Any

from eyas.settings import Settings
from orchestration.settings import ServiceSettings

# stage → (field, setting): the caps a field's own value must keep to; the API schema states them as maxima
# (orchestration.api.openapi). The caps over a sum or product of fields are the checks below.
FIELD_CAPS: dict[str, tuple[tuple[str, str], ...]] = {
    "generate": (("limit", "max_job_prompts"), ("synthesize", "max_job_prompts"),
                 ("sampling.max_tokens", "max_job_tokens")),
    "extract": (("stream.epochs", "max_job_epochs"),),
    "train": (("epochs", "max_job_epochs"), ("steps", "max_job_steps")),
    "evaluate": (("num_prompts", "max_job_prompts"), ("max_new_tokens", "max_job_tokens")),
    "diagnose": (("num_prompts", "max_job_prompts"), ("traffic_prompts", "max_job_prompts"),
                 ("max_new_tokens", "max_job_tokens")),
}


class OverQuota(ValueError):
    """A spec over an operator's quota: `field` and `value` name what is over, `message` the cap."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field}={value!r}: {message}")
        self.field, self.value, self.message = field, value, message


def env_name(setting: str) -> str:
    return f"EYAS_{setting.upper()}"


def _cap(settings: ServiceSettings, setting: str) -> str:
    value = getattr(settings, setting)
    return f"{env_name(setting)}={value:g}" if isinstance(value, float) else f"{env_name(setting)}={value}"


def _exceeds(settings: ServiceSettings, setting: str) -> str:
    return f"exceeds the operator's cap {_cap(settings, setting)}"


def in_process_generation_allowed(settings: ServiceSettings) -> bool:
    """Whether a generate job may name no endpoint (its target then runs in the worker): the setting, else only
    in embedded mode."""
    allowed = settings.allow_in_process_generation
    return settings.mode == "embedded" if allowed is None else allowed


def wall_time_error(settings: ServiceSettings) -> str:
    """The error a job stopped at the wall-time cap records."""
    return f"stopped at the operator's wall-time cap {_cap(settings, 'max_job_minutes')} (minutes of one run)"


def _value(spec: Any, field: str) -> Any:
    for part in field.split("."):
        spec = getattr(spec, part, None)
    return spec


def check_quotas(stage: str, spec: Any, settings: Settings, where: str = "") -> None:
    """Refuse (OverQuota) a parsed spec of `stage` over one of the operator's quotas; `where` prefixes the field
    (`then[1].` for a `then` entry). A cap left unset checks nothing (in-process generation: see its setting)."""
    settings = ServiceSettings.of(settings)
    for field, setting in FIELD_CAPS.get(stage, ()):
        cap, value = getattr(settings, setting), _value(spec, field)
        if cap is not None and isinstance(value, int | float) and value > cap:
            raise OverQuota(where + field, value, _exceeds(settings, setting))
    if stage == "generate":
        _generate(spec, settings, where)
    elif stage == "evaluate":
        _evaluate(spec, settings, where)


def _generate(spec: Any, settings: ServiceSettings, where: str) -> None:
    if spec.endpoint is None and not in_process_generation_allowed(settings):
        why = ("forbidden by the operator (EYAS_ALLOW_IN_PROCESS_GENERATION=false)"
               if settings.allow_in_process_generation is False else
               "off in service mode (EYAS_ALLOW_IN_PROCESS_GENERATION is unset)")
        raise OverQuota(where + "endpoint", None, f"in-process generation (no endpoint: the target would run in the "
                        f"worker) is {why}: name an endpoint")
    prompts_cap, tokens_cap = settings.max_job_prompts, settings.max_job_tokens
    if prompts_cap is None and tokens_cap is None:
        return
    files = [m.prompts for m in spec.mix if m.prompts != "synth"] if spec.mix else [spec.prompts] * bool(spec.prompts)
    if spec.prompts is not None and spec.limit is None:
        setting = "max_job_prompts" if prompts_cap is not None else "max_job_tokens"
        raise OverQuota(where + "limit", None, f"a prompt file's prompts are counted by limit (the first N), which "
                        f"the operator's cap {_cap(settings, setting)} needs: give limit")
    file_prompts = spec.limit if spec.prompts is not None else 0
    if prompts_cap is not None and not spec.mix and file_prompts + spec.synthesize > prompts_cap:
        raise OverQuota(where + "synthesize", spec.synthesize, f"limit {file_prompts} + synthesize "
                        f"{spec.synthesize} = {file_prompts + spec.synthesize} prompts "
                        f"{_exceeds(settings, 'max_job_prompts')}")
    if tokens_cap is None:
        return
    if files and spec.max_turns is None:
        raise OverQuota(where + "max_turns", None, f"a prompt file's conversations are answered turn by turn, up to "
                        f"max_turns, which the operator's cap {_cap(settings, 'max_job_tokens')} needs: give max_turns")
    synth_turns = min(spec.synth_turns, spec.max_turns or spec.synth_turns)
    if spec.mix:
        synth = any(m.prompts == "synth" for m in spec.mix)
        answers = spec.limit * max([spec.max_turns] * bool(files) + [synth_turns] * synth)
    else:
        answers = file_prompts * (spec.max_turns or 0) + spec.synthesize * synth_turns
    tokens = answers * spec.sampling.max_tokens
    if tokens > tokens_cap:
        raise OverQuota(where + "sampling.max_tokens", spec.sampling.max_tokens, f"{answers} answers (prompts × turns) "
                        f"× max_tokens {spec.sampling.max_tokens} = {tokens} tokens "
                        f"{_exceeds(settings, 'max_job_tokens')}")


def _evaluate(spec: Any, settings: ServiceSettings, where: str) -> None:
    if settings.max_job_prompts is None and settings.max_job_tokens is None:
        return
    second = spec.second_num_prompts if spec.second_prompts is not None else 0
    prompts = spec.num_prompts + second
    if settings.max_job_prompts is not None and prompts > settings.max_job_prompts:
        raise OverQuota(where + "second_num_prompts", spec.second_num_prompts, f"num_prompts {spec.num_prompts} + "
                        f"second_num_prompts {second} = {prompts} prompts {_exceeds(settings, 'max_job_prompts')}")
    tokens = prompts * spec.max_new_tokens
    if settings.max_job_tokens is not None and tokens > settings.max_job_tokens:
        raise OverQuota(where + "max_new_tokens", spec.max_new_tokens, f"{prompts} prompts × max_new_tokens "
                        f"{spec.max_new_tokens} = {tokens} tokens {_exceeds(settings, 'max_job_tokens')}")
