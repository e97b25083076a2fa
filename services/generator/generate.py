"""The generation loop: every prompt a Work hands out is conversed through the engine (each assistant turn
conditioned on the regenerated history), throttled, retried, and journaled."""
from __future__ import annotations

import asyncio
import time

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

from eyas.coordination import Work
from eyas.deadline import Deadline, Pace
from eyas.prompts import Prompt
from eyas.stage import Cancelled, StageContext
from services.generator.engine import Completion, Engine, EngineError, request_timeout
from services.generator.journal import Journal
from services.generator.retry import DeadLetter, backoff, retryable
from services.generator.spec import Spec
from services.generator.throttle import Throttle

# A retry after a timeout waits this many times the slowest answer the job has had (doubled for each further
# timeout of the same request), never more than the full timeout: a request that hung past the full timeout is
# more likely lost at the server than slow, and a chain of full timeouts would set the job's wall time. At 2x, a
# full batch's slowest answers put the retry at the full timeout again: a prompt that hung twice cost two
# (bench/README.md § Measured defaults).
RETRY_TIMEOUT_FACTOR = 1.5


def retry_timeout(slowest_s: float, timeouts: int, full_s: float) -> float | None:
    """The read timeout of a request's next attempt after `timeouts` of its attempts timed out: the full one (None)
    before any, or while no answer has come yet; else RETRY_TIMEOUT_FACTOR × the slowest answer so far, doubled per
    timeout after the first, below the full one."""
    if not timeouts or slowest_s <= 0:
        return None
    shrunk = RETRY_TIMEOUT_FACTOR * slowest_s * 2 ** (timeouts - 1)
    return shrunk if shrunk < full_s else None


# A prompt is started while this share of its time (as long as recent ones took) still fits before the deadline: a
# unit that is large against the deadline (in-process, a batch of answers is a quarter of generation's share in a
# 10-minute run) would otherwise be dropped whole when the time left is a little short of it. The answers to a
# synthesized batch are what its synthesis was for: a hog that slowed one batch's synthesis left its answers a
# little short of fitting, and dropping them halved the run's data and lost τ
# (bench/README.md § Measured defaults). At a half, the last unit ends at the deadline on average. Synthesis
# draws a round only while it and this share of its batch's answers fit (services/generator/gather.py).
START_WHILE_FITS = 0.5


class Unstarted(Exception):
    """A prompt whose first request was not sent: the job's deadline came while it waited for a slot."""


class Generator:
    """Regenerates a prompt set through an engine: throttled (AIMD within a global maximum), retried, journaled."""

    def __init__(self, spec: Spec, engine: Engine, throttle: Throttle, journal: Journal, ctx: StageContext):
        self.spec, self.engine, self.throttle, self.journal, self.ctx = spec, engine, throttle, journal, ctx
        self.stats = {"completed": 0, "failed": 0, "retried": 0, "completion_tokens": 0}
        self._backoff = backoff(spec.retry_wait_s)
        self._t0 = time.monotonic()
        self.deadline = Deadline(spec.finish_by)
        self.slowest_s = 0.0  # the longest a successful answer took (queueing at the server included)
        self.full_timeout_s = spec.request_timeout_s or request_timeout(spec.sampling.max_tokens)
        # seconds a conversation's requests take once sent (in-process: its batch's time); not from its claim: a
        # prompt claimed early waits for a slot behind the batch before it
        self.pace = Pace(window=64)
        self.stopped_at_deadline = False

    def must_fit_s(self) -> float:
        """Seconds before the deadline a prompt needs to be started (0 before the first one ended)."""
        return START_WHILE_FITS * self.pace.seconds()

    def _past_deadline(self) -> bool:
        """Whether less than START_WHILE_FITS of a prompt started now (as long as recent ones took) would end by the
        job's deadline: then this process takes no more."""
        if self.deadline and not self.deadline.fits(self.must_fit_s()):
            self.stopped_at_deadline = True
        return self.stopped_at_deadline

    async def _turn(self, prompt_id: str, messages: list[dict], first: bool = False) -> Completion:
        """One assistant turn, retried; the conversation's `first` turn is not sent once past the deadline (a prompt
        claimed early may wait for a slot while the batch before it runs)."""
        attempts = timeouts = 0
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(self.spec.max_attempts), wait=self._backoff,
                                               retry=retry_if_exception(retryable), reraise=True):
                with attempt:
                    attempts += 1
                    if attempts > 1:
                        self.stats["retried"] += 1
                    async with self.throttle.slot(first=attempts > 1) as sent:
                        if first and attempts == 1 and self._past_deadline():
                            raise Unstarted(prompt_id)
                        try:
                            c = await self.engine.chat(messages, self.spec.sampling,
                                                       retry_timeout(self.slowest_s, timeouts, self.full_timeout_s))
                        except EngineError as e:
                            timeouts += e.timed_out
                            if retryable(e):  # overload or a failing server: congestion, if errors are common
                                await self.throttle.failure(sent)
                            raise
                        self.slowest_s = max(self.slowest_s, c.latency_s)
                        await self.throttle.success(sent, c.latency_s, c.completion_tokens)
                    return c
        except EngineError as e:
            raise DeadLetter(prompt_id, str(e), attempts) from e
        raise AssertionError("unreachable")

    async def converse(self, prompt: Prompt) -> dict:
        """Each assistant turn is conditioned on the regenerated history; the system prompt is kept."""
        messages: list[dict] = [{"role": "system", "content": prompt.system}] if prompt.system else []
        turns = []
        for user in prompt.user_turns[: self.spec.max_turns]:
            messages.append({"role": "user", "content": user})
            c = await self._turn(prompt.id, [{"role": m["role"], "content": m["content"]} for m in messages],
                                 first=not turns)
            reply = {"role": "assistant", "content": c.content}
            if c.reasoning_content:
                reply["reasoning_content"] = c.reasoning_content
            messages.append(reply)
            turns.append({"finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                          "completion_tokens": c.completion_tokens, "latency_s": round(c.latency_s, 3)})
        return {"id": prompt.id, "source": prompt.source, "messages": messages, "turns": turns,
                "sampling": self.spec.sampling.model_dump(exclude={"chat_template_kwargs"}),
                "chat_template_kwargs": self.spec.sampling.chat_template_kwargs,
                **({"meta": prompt.meta} if prompt.meta else {})}

    def _report(self, work: Work, total: int, already: int) -> None:
        """The owner's view on the job record: every participant's finished prompts, its own rates."""
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        self.ctx.metrics.update(**self.stats, in_flight=self.throttle.in_flight,
                                concurrency=round(self.throttle.limit.limit, 2),
                                tokens_per_s=round(self.stats["completion_tokens"] / elapsed, 1))
        own = self.stats["completed"] + self.stats["failed"]
        self.ctx.progress(already + max(own, work.finished_count()), total, "prompts")

    async def run(self, prompts: dict[str, Prompt], work: Work, already: int = 0, owner: bool = True) -> None:
        """Generate the prompts `work` hands out, journaling each; `already` were finished before. The owner
        also waits until no prompt is open anywhere (taking over the claims of participants that died)."""
        from tqdm.asyncio import tqdm

        total = already + len(prompts) if owner else len(prompts)
        bar = tqdm(total=total, initial=already, desc="generate", unit="prompt")

        async def worker():
            while True:
                if self._past_deadline():
                    await self.journal.commit()
                    return
                prompt_id = work.claim()
                if prompt_id is None:
                    await self.journal.commit()  # commit (and so release) what this process holds before waiting
                    if not owner or work.open_count() == 0:
                        return
                    await asyncio.sleep(0.5)  # others hold claims: wait, and take over any that lapse
                    self._report(work, total, already)
                    continue
                try:
                    rec = await self.converse(prompts[prompt_id])
                    self.pace.add(sum(t["latency_s"] for t in rec["turns"]))
                except Unstarted:  # past the deadline: the prompt stays unreached, and this task takes no more
                    await self.journal.commit()
                    return
                except DeadLetter as e:
                    self.journal.add_dead(e.record)
                    self.stats["failed"] += 1
                else:
                    self.journal.add(rec)
                    self.stats["completed"] += 1
                    self.stats["completion_tokens"] += sum(t["completion_tokens"] for t in rec["turns"])
                bar.update(1)
                if owner:
                    self._report(work, total, already)

        # Two tasks per slot this process may hold, so that prompts waiting out a retry's backoff leave no slot idle;
        # the throttle decides how many are in flight.
        try:
            await asyncio.gather(*(worker() for _ in range(max(1, min(2 * self.throttle.most, len(prompts))))))
        except (asyncio.CancelledError, Cancelled):
            self.journal.flush()  # the samples finished so far stay: a rerun resumes from them
            raise
        self.journal.flush()
        bar.close()
