"""Worker-side capture: the final-norm state of the last prompt token, once per
request, taken from the rows vLLM already computes for sampling.

How a step flows (one worker process, one ``WorkerCapture``):

1. The runner's adapter (``vllm_pamer/adapters/``) begins a step with its
   neutral view (``step.py``) when the step starts, and ends it when it
   returns. Dummy/profile runs never start a step and so never capture.
2. The adapter hands the rows sampling reads (final-norm states, one per
   request's last scheduled token) to ``observe``. The first call of a step
   is the sampling call; later calls in the same step (prompt logprobs) find
   the capture disarmed.
3. ``observe`` picks the rows of requests whose prompt prefill completes in
   this step at a sampled row (``ScheduledRequest.prompt_row``), skipping
   requests already captured (re-prefill after preemption), evaluates the
   five heads on them, searches their sessions' memory rows (``memory.py``)
   and publishes one record per request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vllm_pamer.channel import CAPTURE_KEY, SESSION_KEY, CapturePublisher, CaptureRecord
from vllm_pamer.core.heads import Heads, ModelFingerprint, load_heads
from vllm_pamer.settings import Settings
from vllm_pamer.worker.layer_taps import LayerTaps, parse_layers
from vllm_pamer.worker.memory import WorkerMemory
from vllm_pamer.worker.step import StepView

if TYPE_CHECKING:
    from vllm_pamer.kernels import FiveHeadVote

logger = logging.getLogger("vllm_pamer.capture")


def _torch_heads(heads: Heads, device: torch.device):
    """The heads on the capture device (``kernels.FiveHeadVote``); imported in
    the worker only. On CUDA a bf16 engine's rows are voted on with W1 in
    bf16: exact products, fp32 sums, and on real states the decisions of fp32
    heads (``tests/kernels/test_five_head_vote_bf16.py``)."""
    from vllm_pamer.kernels import FiveHeadVote

    w1, b1, w2, b2, thresholds = (torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds"))
    cuda = torch.device(device).type == "cuda"
    return FiveHeadVote(w1, b1, w2, b2, thresholds, heads.min_votes, device, bf16_heads=cuda)


class WorkerCapture:
    def __init__(
        self, settings: Settings, fingerprint: ModelFingerprint, device: torch.device, memory: bool = False
    ) -> None:
        """``memory``: hold memory rows for recall (the API server can push them:
        vLLM runs the plugin's worker extension)."""
        self.enabled = settings.capture
        self.heads: FiveHeadVote | None = None
        if settings.heads:
            heads = load_heads(settings.heads)
            heads.check_model(fingerprint, settings.heads)  # wrong model: start-up error
            self.heads = _torch_heads(heads, device)
        self.memory = (
            WorkerMemory(fingerprint.hidden_size, settings.memory_rows, device)
            if memory and self.enabled and settings.memory_rows
            else None
        )
        self.publisher = CapturePublisher()
        self.captured: set[str] = set()
        self.captures_total = 0
        self._armed: StepView | None = None
        self._warned_layout = False
        blocks = parse_layers(settings.capture_layers)
        self.taps: LayerTaps | None = LayerTaps(blocks) if (self.enabled and blocks) else None

    def attach_model(self, model: torch.nn.Module) -> None:
        """Install the layer taps (only when ``PAMER_CAPTURE_LAYERS`` is set)."""
        if self.taps is not None:
            self.taps.attach(model)

    # -- step bracket (called by the runner's adapter) ----------------------------
    def begin_step(self, step: StepView) -> None:
        for req_id in step.finished:
            self.captured.discard(req_id)
        self._armed = step if self.enabled else None
        if self.taps is not None:  # only made when capture is enabled
            self.taps.begin_step(step)

    def end_step(self) -> None:
        self._armed = None
        if self.taps is not None:
            self.taps.end_step()

    # -- the capture itself ----------------------------------------------------
    def observe(self, hidden_states: torch.Tensor) -> None:
        step, self._armed = self._armed, None
        if step is None or hidden_states is None or not step.prefilling:
            return
        picks = self._completed_prefill_rows(step, hidden_states.shape[0])
        if not picks:
            return
        rows = hidden_states[torch.tensor([row for row, _ in picks], device=hidden_states.device)]
        logits = votes = compress = None
        heads_error = None
        voted = None
        if self.heads is not None:
            try:
                voted = self.heads(rows)
            except Exception as exc:  # probe failure: reported, never fatal
                heads_error = f"{type(exc).__name__}: {exc}"
        recalls: list = [None] * len(picks)
        if self.memory is not None:
            try:
                recalls = self.memory.recall([session for _, (_, _, session, _) in picks], rows)
            except Exception:  # the API server scores them instead
                logger.exception("vllm-pamer: recall in the worker failed")
        # states and the vote to the host in one copy: one wait for the device, not four
        width = rows.shape[1]
        parts = [rows.float()]
        if voted is not None:
            parts += [voted[0].float(), voted[1].float()[:, None], voted[2].float()[:, None]]
        host = torch.cat(parts, dim=1).cpu()
        states = host[:, :width].numpy().astype("<f4")
        if voted is not None:
            logits, votes, compress = host[:, width:-2], host[:, -2].int(), host[:, -1].bool()
        for i, (_, (req_id, key, session, n_prompt)) in enumerate(picks):
            self.captured.add(req_id)
            self.captures_total += 1
            layers = self.taps.pop(req_id) if self.taps is not None else None
            self.publisher.publish(
                CaptureRecord(
                    key=key,
                    request_id=req_id,
                    session_id=session,
                    num_prompt_tokens=n_prompt,
                    hidden=states[i].tobytes(),
                    head_logits=None if logits is None else [float(v) for v in logits[i]],
                    votes=None if votes is None else int(votes[i]),
                    compress_vote=None if compress is None else bool(compress[i]),
                    heads_error=heads_error,
                    layers=None if layers is None else layers[0],
                    layer_tokens=None if layers is None else layers[1],
                    recall=recalls[i],
                )
            )

    def _completed_prefill_rows(self, step: StepView, num_rows: int):
        picks = []
        row = 0
        for request in step.requests():
            at = request.prompt_row()
            if at is not None and request.req_id not in self.captured:
                extra = step.extra_args(request.req_id)
                session = extra.get(SESSION_KEY)
                session = session if isinstance(session, str) else None
                picks.append((row + at, (request.req_id, extra.get(CAPTURE_KEY), session, request.prompt)))
            row += request.logit_rows
        if row != num_rows:
            if not self._warned_layout:
                logger.warning(
                    "vllm-pamer: %d logits rows for %d expected; capture skipped for this step",
                    num_rows,
                    row,
                )
                self._warned_layout = True
            return []
        return picks


_worker_capture: WorkerCapture | None = None


def get_worker_capture() -> WorkerCapture | None:
    return _worker_capture


def init_worker_capture(fingerprint: ModelFingerprint, device: torch.device, memory: bool) -> WorkerCapture:
    """Create this process's capture (once), loading and checking the heads."""
    global _worker_capture
    if _worker_capture is None:
        _worker_capture = WorkerCapture(Settings.from_env(), fingerprint, device, memory)
    return _worker_capture
