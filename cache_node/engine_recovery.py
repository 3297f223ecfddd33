"""How the engine survives a failed step (mixed into ``LLMEngine``): a ``SequenceFault`` fails
the request it names; a failure naming none is told apart by running each suspect's failed step
alone (``Sequence.isolate_at``, ``Scheduler.schedule_alone``), with canary steps to tell a broken
runner from a broken request; ``MAX_FAILED_STEPS`` batched failures in a row re-raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_node.kv_cache_manager import KVCacheManager
from cache_node.model_runner import ModelRunner, ScheduledBatch
from cache_node.outputs import RequestOutput, SequenceFault
from cache_node.sampling_params import SamplingParams
from cache_node.scheduler import Scheduler
from cache_node.sequence import Sequence

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # steps in a row failing in the runner itself (no policy to blame) before ``step`` re-raises


class EngineRecoveryMixin:
    """Failed-step recovery of ``LLMEngine`` (which provides these attributes)."""

    requests: dict[str, Sequence]
    scheduler: Scheduler
    kv_manager: KVCacheManager
    runner: ModelRunner
    num_steps: int
    num_failed_requests: int
    _failed_steps: int
    _suspects: dict[str, int]
    _alone: bool
    _finish: Callable[[Sequence, str], None]
    _output: Callable[[Sequence, tuple[int, ...]], RequestOutput]

    def _schedule(self) -> ScheduledBatch:
        """The step's batch: a suspect's failed step alone when one has recomputed up to it
        (``Sequence.isolate_at``, ``_recover``), else the scheduler's pick (in which suspects
        recompute up to their failed step with the others)."""
        self._alone = False
        for request_id, need in list(self._suspects.items()):
            seq = self.requests.get(request_id)
            if seq is None or seq.is_finished or seq.num_computed_tokens >= need:
                self._clear_suspect(request_id, seq)  # passed the step, or gone
                continue
            assert seq.isolate_at is not None
            if seq.num_computed_tokens >= seq.isolate_at:
                batch = self.scheduler.schedule_alone(seq)
                if batch:
                    self._alone = True
                    return batch
                self._clear_suspect(request_id, seq)  # cannot run alone now: steps as any
        return self.scheduler.schedule()

    def _clear_suspect(self, request_id: str, seq: Sequence | None) -> None:
        del self._suspects[request_id]
        if seq is not None:
            seq.isolate_at = None

    def _recover(self, batch: ScheduledBatch, exc: Exception, outputs: list[RequestOutput]) -> None:
        """The forward pass raised: its KV writes are partial. A ``SequenceFault`` names the
        request whose policy failed: that request alone finishes with "error" and the rest of
        the batch is preempted, so it recomputes its KV instead of trusting half-written
        slots. An exception naming no request (the model runner itself) is told apart: every
        sequence of the batch is preempted, recomputes up to the step that failed in batches
        as usual, and runs that step alone (``_schedule``); a step of one sequence that fails
        is that sequence's, which finishes with "error". Should a batch holding such a
        sequence fail before it got there, each of that batch's sequences recomputes alone
        from its start. ``MAX_FAILED_STEPS`` batched steps in a row failing with no policy to
        blame re-raise (the node is broken, not a request: its supervisor restarts it); the
        steps that tell a failed batch apart do not count, nor does a failed step of one
        sequence after which a canary step runs (``_runner_works``).

        Regressions: a policy exception inside ``step`` stopped the node's step loop and failed
        every tenant's requests on it; then an exception naming no request failed its whole
        batch, so one tenant's request that broke the forward pass failed every other tenant's
        request stepping with it, and three in a row restarted the node; then, on an otherwise
        idle node, three such requests of one tenant in a row (each alone in its step)
        restarted it, and every other tenant's sessions and stored prefixes on it were lost.
        """
        live = [(seq, n) for seq, n in batch if not seq.is_finished]
        culprit = exc.request_id if isinstance(exc, SequenceFault) else None
        escalate = False  # a batch holding a sequence of an earlier failed batch failed again
        if not isinstance(exc, SequenceFault):
            escalate = not self._alone and any(seq.isolate_at is not None for seq, _ in live)
            if len(live) == 1:
                culprit = live[0][0].request_id
            if not self._alone and not escalate and not (culprit and self._runner_works()):
                self._failed_steps += 1
        log.error("step %d failed (%s): %s", self.num_steps, "request " + culprit if culprit else "batch",
                  exc, exc_info=exc)
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise exc
        for seq, n in live:
            if seq.request_id == culprit:
                self._fail(seq, outputs)
                continue
            if culprit is None:  # runs its step alone once it has recomputed up to it
                need = min(seq.num_computed_tokens + n, seq.num_tokens)
                self._suspects[seq.request_id] = max(need, self._suspects.get(seq.request_id, 0))
                seq.isolate_at = 0 if escalate else seq.num_computed_tokens
            if seq in self.scheduler.running:
                self.scheduler.preempt(seq)

    def _runner_works(self) -> bool:
        """Canary steps: a scratch sequence (one block, no KV policy) through the model
        runner, a one-token prefill then a one-token decode (the prefill and the decode path,
        CUDA graphs included, as a failed step may have taken either). True when both ran:
        the step of one sequence that failed before them was that request's, not a broken
        runner's. False when one raised, or when no block is free to run them."""
        canary = Sequence("canary", [0, 0], SamplingParams(max_tokens=1))
        if self.kv_manager.allocate_slots(canary, 2) is None:
            return False
        try:
            self.runner.execute([(canary, 1)])
            canary.num_computed_tokens = 1
            self.runner.execute([(canary, 1)])
        except Exception as exc:  # noqa: BLE001 - the failed step counts then
            log.error("canary step failed: %s", exc)
            return False
        finally:
            self.kv_manager.free(canary)
        return True

    def _fail(self, seq: Sequence, outputs: list[RequestOutput]) -> None:
        """Finish ``seq`` with "error": its blocks go back, a session keeps its earlier history."""
        self.num_failed_requests += 1
        self._finish(seq, "error")
        outputs.append(self._output(seq, ()))
