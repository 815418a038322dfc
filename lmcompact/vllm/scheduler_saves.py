"""Save planning of the scheduler half: which query positions the worker captures, which
chunks it saves, and what a request's ``kv_transfer_params`` ask of both (no save, given
``token_scores``, a reconstruction pass: :mod:`lmcompact.vllm.reconstruct`).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

from lmcompact.policies import Need
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.metadata import (
    CaptureSpec,
    ReconstructCapture,
    SaveSpec,
    StepMetadata,
)
from lmcompact.vllm.reconstruct import (
    ReconstructRequest,
    reconstruct_request,
    save_allowed,
    token_scores,
)
from lmcompact.vllm.request_state import RequestState
from lmcompact.vllm.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


class SavePlanning(SchedulerState):
    """Request options, query captures and chunk saves."""

    def _given_scores(self, request: Any, tracked: RequestState) -> None:
        """Read a request's ``save`` flag and ``token_scores`` (``reconstruct.py``)."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            tracked.no_save = not save_allowed(params)
            scores = token_scores(params, len(tracked.prompt))
        except ValueError as error:
            logger.error("request %s: %s; served as a plain request", request.request_id, error)
            return
        if scores is not None and Need.CONTEXT_SCORES not in self.policy.needs:
            logger.error(
                "request %s gives token_scores, but policy %r does not read context scores; "
                "ignored",
                request.request_id,
                self.config.store_policy_name,
            )
            return
        tracked.token_scores = scores

    def _reconstruct_len(self, request: Any, prompt: list[int]) -> ReconstructRequest | None:
        """The parts of ``request`` when it is a valid reconstruction pass the policy can use."""
        try:
            t = reconstruct_request(getattr(request, "kv_transfer_params", None), prompt)
        except ValueError as error:
            logger.error("request %s: %s; served as a plain request", request.request_id, error)
            return None
        if t is None:
            return None
        if not self.config.store.save or Need.CONTEXT_SCORES not in self.policy.needs:
            logger.error(
                "request %s asks for a reconstruction pass, but policy %r (save=%s) does not "
                "store chunks scored by one; served as a plain request, nothing stored",
                request.request_id,
                self.config.store_policy_name,
                self.config.store.save,
            )
            return None
        logger.info(
            "request %s is a reconstruction pass: stores its first %d tokens, scored by the "
            "queries from position %d",
            request.request_id,
            t.context_len,
            t.copy_start,
        )
        return t

    def capture_positions(self, prompt_len: int) -> list[int]:
        """Sorted prompt positions whose queries the worker copies for the save: the last
        ``window`` (observation window) and the policy's ``context_queries`` (KVzip's
        sample across the prompt)."""
        wanted = set(range(max(0, prompt_len - self.config.window), prompt_len))
        sampled = self.policy.context_queries(prompt_len)
        if sampled is not None:
            wanted.update(int(p) for p in sampled.tolist())
        return sorted(wanted)

    def _plan_save(
        self, sched: shim.ScheduledRequest, tracked: RequestState, meta: StepMetadata
    ) -> None:
        """Query captures in the steps that compute the wanted prompt positions; the save in
        the step that completes the prompt."""
        if not self.config.store.save or tracked.saved or tracked.no_save:
            return
        c, bs = self.config.store.chunk_size, self.facts.block_size
        prompt_len = len(tracked.prompt)
        lo, hi = sched.num_computed, min(sched.num_computed + sched.num_scheduled, prompt_len)
        recon = tracked.reconstruct
        if tracked.capture is None:
            tracked.capture = (
                self.capture_positions(prompt_len)
                if recon is None
                else list(range(recon.copy_start, prompt_len))  # the repeated copy
            )
        first, last = (
            bisect.bisect_left(tracked.capture, lo),
            bisect.bisect_left(tracked.capture, hi),
        )
        if first < last:
            positions = tracked.capture[first:last]
            slots = [tracked.block_ids[p // bs] * bs + p % bs for p in positions]
            scored = (
                None
                if recon is None
                else ReconstructCapture(list(tracked.block_ids), recon.context_len)
            )
            meta.captures.append(CaptureSpec(sched.req_id, slots, positions, scored))
        if hi < prompt_len:
            return
        tracked.saved = True
        # never the second copy
        n_full = prompt_len // c if recon is None else recon.context_len // c
        first = tracked.loaded_end // c
        if first < n_full:
            first = max(first, self._present(tracked, 0, n_full))
        while first < n_full and self._save_in_flight(tracked.keys[first]):
            first += 1  # another request is saving the same leading chunks right now
        if first >= n_full:
            return
        if recon is None and tracked.token_scores is None and self.policy.scores_given:
            logger.warning(
                "request %s: policy %r scores with token_scores given with the storing "
                "request (lmcompact.vllm.reconstruct.store_surprisal_context); this one has "
                "none, its %d new chunks are not stored",
                sched.req_id,
                self.config.store_policy_name,
                n_full - first,
            )
            return
        keys = tracked.keys[first:n_full]
        now = time.monotonic()
        self._saving.update((s, now) for key in keys for s in self._slices(key))
        meta.saves.append(
            SaveSpec(
                req_id=sched.req_id,
                block_ids=list(tracked.block_ids),
                keys=keys,
                start=first * c,
                num_tokens=(prompt_len if recon is None else recon.context_len) - first * c,
                reconstruct=recon is not None,
                token_scores=(
                    None if tracked.token_scores is None else tracked.token_scores[first * c :]
                ),
            )
        )
