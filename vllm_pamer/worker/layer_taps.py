"""Worker-side layer taps: per-request states of chosen decoder blocks and of
the final norm, at the last prompt token and averaged over the prompt, for the
paper's depth diagnostic (AUROC by layer, last vs mean pooling).

Off unless ``PAMER_CAPTURE_LAYERS`` names blocks (``vllm-pamer extract
--layers`` sets it); serving never pays for it. Forward hooks read what the
forward pass already computes, no extra pass runs:

* block ``n`` (1-based) is the residual stream after the ``n``-th decoder
  layer. vLLM's layers return ``(hidden, residual)`` with the residual add
  deferred to the next norm, so the stream is ``hidden + residual`` (HF's
  ``hidden_states[n]``);
* ``norm`` is the final norm's output (what the heads read).

A step's tokens are laid out request by request in the input batch's order,
``num_scheduled_tokens`` each (the same layout ``WorkerCapture`` relies on for
logits rows). For each request still in its prompt, the rows of this chunk are
summed per tap; the chunk that completes the prompt also gives the last row.
Mean pooling covers computed tokens only: tokens served from the prefix cache
never pass through the layers, so ``pop`` reports how many were seen and the
extractor turns prefix caching off. Hooks need eager execution (no CUDA graphs
or torch.compile), which the extractor sets.
"""

from __future__ import annotations

import logging

import torch

from vllm_pamer.worker.step import StepView

logger = logging.getLogger("vllm_pamer.layer_taps")

NORM = "norm"


def parse_layers(text: str | None) -> list[int]:
    """``"4,8,15"`` -> sorted unique 1-based block numbers; empty -> []."""
    if not text:
        return []
    try:
        blocks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"PAMER_CAPTURE_LAYERS must be block numbers like '4,8,15', not {text!r}") from None
    if blocks and blocks[0] < 1:
        raise ValueError(f"block numbers start at 1, got {blocks[0]}")
    return blocks


def blocks_at_depths(num_layers: int, fractions=(0.125, 0.25, 0.5, 0.75)) -> list[int]:
    """Block numbers at the given shares of the depth (the final norm is always
    tapped besides): 30 layers -> [4, 8, 15, 22]."""
    return sorted({min(num_layers, max(1, round(num_layers * f))) for f in fractions})


def tap_names(blocks: list[int]) -> list[str]:
    return [f"block{b}" for b in blocks] + [NORM]


class _Pending:
    """One request's running sums over its prompt so far."""

    __slots__ = ("last", "sums", "tokens")

    def __init__(self, n_taps: int, width: int, device: torch.device) -> None:
        self.sums = torch.zeros(n_taps, width, dtype=torch.float32, device=device)
        self.last = torch.zeros(n_taps, width, dtype=torch.float32, device=device)
        self.tokens = 0


class LayerTaps:
    def __init__(self, blocks: list[int]) -> None:
        self.blocks = list(blocks)
        self.names = tap_names(self.blocks)
        self._pending: dict[str, _Pending] = {}
        self._step: StepView | None = None
        self._segments: list[tuple[str, int, int, bool]] | None = None
        self._step_tokens = 0
        self._warned = False

    # -- install ----------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Hook the decoder layers and final norm of a vLLM ``*ForCausalLM``."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        norm = getattr(inner, "norm", None)
        if layers is None or norm is None:
            raise RuntimeError(f"{type(model).__name__}: no model.layers / model.norm to tap")
        if self.blocks and self.blocks[-1] > len(layers):
            raise ValueError(f"block {self.blocks[-1]} asked for, the model has {len(layers)} layers")
        for tap, block in enumerate(self.blocks):
            layers[block - 1].register_forward_hook(self._hook(tap))
        norm.register_forward_hook(self._hook(len(self.blocks)))

    def _hook(self, tap: int):
        def hook(_module, _inputs, output) -> None:
            if self._step is None:
                return
            if self._segments is None:
                self._layout()
            if not self._segments:
                return
            if isinstance(output, tuple):  # decoder layer: (hidden, residual); norm: (normed, residual)
                hidden = output[0]
                if tap < len(self.blocks) and len(output) > 1 and output[1] is not None:
                    hidden = hidden + output[1]
            else:
                hidden = output
            self._add(tap, hidden)

        return hook

    # -- step bracket (from WorkerCapture.arm / disarm) ---------------------------
    def begin_step(self, step: StepView) -> None:
        for req_id in step.finished:
            self._pending.pop(req_id, None)
        self._step = step
        self._segments = None

    def _layout(self) -> None:
        """Which rows of this step belong to which prompt. Worked out at the
        first hook call: the runner adds a step's new requests to its input
        batch after ``execute_model`` starts, before the forward pass."""
        assert self._step is not None
        segments = []
        row = 0
        for request in self._step.requests():
            if request.computed == 0:
                self._pending.pop(request.req_id, None)  # a fresh prefill (also after preemption)
            if request.computed < request.prompt and request.scheduled:
                n_rows = min(request.scheduled, request.prompt - request.computed)
                segments.append((request.req_id, row, n_rows, request.computed + n_rows == request.prompt))
            row += request.scheduled  # draft tokens included (vLLM schedules them as tokens)
        self._segments = segments
        self._step_tokens = row

    def end_step(self) -> None:
        self._step = None
        self._segments = None

    def _add(self, tap: int, hidden: torch.Tensor) -> None:
        if hidden.shape[0] < self._step_tokens:
            if not self._warned:
                logger.warning(
                    "vllm-pamer: %d rows for %d scheduled tokens; layer taps skipped",
                    hidden.shape[0],
                    self._step_tokens,
                )
                self._warned = True
            return
        for req_id, start, n_rows, completes in self._segments or ():
            pending = self._pending.get(req_id)
            if pending is None:
                pending = self._pending[req_id] = _Pending(len(self.names), hidden.shape[1], hidden.device)
            rows = hidden[start : start + n_rows].float()
            pending.sums[tap] += rows.sum(dim=0)
            if completes:
                pending.last[tap] = rows[-1]
            if tap == 0:  # each hook fires once per forward pass
                pending.tokens += n_rows

    # -- read out (from WorkerCapture.observe) -----------------------------------
    def pop(self, req_id: str) -> tuple[bytes, int] | None:
        """``([2, n_taps, d] float32 bytes: last then mean, tokens averaged)``
        for a request whose prompt just completed, and forget it."""
        pending = self._pending.pop(req_id, None)
        if pending is None or pending.tokens == 0:
            return None
        mean = pending.sums / pending.tokens
        both = torch.stack([pending.last, mean]).cpu().numpy().astype("<f4")
        return both.tobytes(), pending.tokens
