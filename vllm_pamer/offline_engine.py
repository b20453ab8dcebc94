"""The one offline capture: an offline vLLM engine that hands back the states
the capture plugin publishes. ``CaptureEngine`` runs prompts of token ids (or
texts, tokenized as the server embeds them) through vLLM's ``LLM``, each
tagged with a capture key, and collects each prompt's capture record from the
PULL end of the capture channel (``vllm_pamer.channel``), bound in this
process. ``vllm-pamer extract``, ``benchmarks/retrieval.py`` and the engine
tests (marker ``engine``) drive it; the vLLM calls themselves are in
``vllm_pamer.adapters.offline``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_pamer.channel import CAPTURE_KEY, CHANNEL_ENV, CaptureReceiver


class CaptureError(RuntimeError):
    """The model cannot be captured, or the engine did not deliver a state."""


def _vllm():
    """The vLLM calls, imported on first use: after ``prepare_vllm_cpu``."""
    from vllm_pamer.adapters import offline

    return offline


def _set_environ(values: Mapping[str, str | None]) -> None:
    """Set each variable, or unset it where the value is None."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
"""How Hugging Face names the architectures that compute logits (a pooling
model, ``...Model`` or ``...ForSequenceClassification``, samples nothing to capture)."""


def check_architecture(model: str | Path) -> None:
    """Refuse a model that computes no logits: no state would come back (any
    generative architecture is captured, ``adapters/vllm_from_0_32/models.py``)."""
    from transformers import AutoConfig

    architectures = getattr(AutoConfig.from_pretrained(str(model)), "architectures", None) or []
    if not any(a.endswith(GENERATIVE_SUFFIXES) for a in architectures):
        raise CaptureError(f"{model}: architecture {architectures} is not generative; nothing would be captured")


class CaptureEngine:
    """An offline vLLM ``LLM`` with the capture plugin, and the PULL end of its
    capture channel bound in this process. ``states(prompts)`` runs one batch.
    Close it (or use it as a context manager): that shuts the engine down.
    The workers vote with ``heads`` (a heads file) where given, else they
    capture the state only.

    Prefix caching is on, except with ``layers`` (1-based decoder blocks to
    tap besides the final norm: mean pooling needs every token computed; eager
    execution then too, for the hooks). On the CPU backend ``enforce_eager``
    defaults to True, ``gpu_memory_utilization`` (there: the share of RAM for
    the KV cache) to 0.2, and the worker uses every core
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless set; ``all_cpu_cores=False``
    keeps vLLM's reserved core, and with it the thread count, which changes
    the rounding of bf16 sums)."""

    def __init__(
        self,
        model: str | Path,
        *,
        max_model_len: int | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        capture_timeout_s: float = 30.0,
        layers: Sequence[int] | None = None,
        heads: str | Path | None = None,
        all_cpu_cores: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        from vllm_pamer.adapters.launch import cpu_default_dtype, is_cpu_build, prepare_vllm_cpu

        cpu = is_cpu_build()
        prepare_vllm_cpu()
        if dtype == "auto":  # as `vllm-pamer serve` serves it (fp32 on a CPU without native bf16)
            dtype = cpu_default_dtype() or "auto"
        check_architecture(model)
        vllm = _vllm()  # before the environment overrides below, which are for the engine's processes

        self.capture_timeout_s = capture_timeout_s
        self._dir = tempfile.mkdtemp(prefix="pamer-extract-")
        self.address = f"ipc://{self._dir}/capture.sock"
        self._receiver: CaptureReceiver | None = CaptureReceiver(self.address)
        self._nonce = uuid.uuid4().hex[:12]
        self._batches = 0
        self.llm = None
        self.layers = sorted(set(int(b) for b in layers)) if layers else []

        kwargs: dict[str, Any] = dict(
            model=str(model),
            dtype=dtype,
            enforce_eager=True if self.layers else (cpu if enforce_eager is None else enforce_eager),
            enable_prefix_caching=not self.layers,
            seed=seed,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if gpu_memory_utilization is not None or cpu:
            # on the CPU backend: the share of RAM kept for the KV cache
            kwargs["gpu_memory_utilization"] = 0.2 if gpu_memory_utilization is None else gpu_memory_utilization
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        kwargs.update(llm_kwargs)

        # The engine's processes inherit these: our channel, capture on, the
        # heads asked for (none: only the state is needed), and the plugin loaded.
        overrides: dict[str, str | None] = {
            CHANNEL_ENV: self.address,
            "PAMER_CAPTURE": "1",
            "PAMER_HEADS": None if heads is None else str(heads),
            "PAMER_CAPTURE_LAYERS": ",".join(map(str, self.layers)) or None,
        }
        if cpu and all_cpu_cores and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            # vLLM keeps one core off the OpenMP pool for its scheduler process;
            # an offline batch has nothing to interleave, and on small machines
            # the pool of all cores is nearly twice as fast (2 cores: measured).
            overrides["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins and "pamer" not in plugins.split(","):
            overrides["VLLM_PLUGINS"] = plugins + ",pamer"
        saved = {k: os.environ.get(k) for k in overrides}
        try:
            _set_environ(overrides)
            self.llm = vllm.make_llm(**kwargs)
        except BaseException:
            self._close_socket()
            raise
        finally:
            _set_environ(saved)
        self.max_model_len = vllm.max_model_len(self.llm)
        self.block_size = vllm.kv_block_size(self.llm)
        self.dtype = vllm.model_dtype(self.llm)

    def get_tokenizer(self) -> Any:
        return _vllm().tokenizer(self.llm)

    def text_ids(self, text: str) -> list[int]:
        """``text`` as the server embeds it (``EngineServices.embed``,
        ``server/services.py``): no special tokens, its end kept in the window."""
        return self.get_tokenizer().encode(text, add_special_tokens=False)[-(self.max_model_len - 2) :] or [0]

    def text_states(self, texts: Sequence[str], on_state: Callable[[int], None] | None = None) -> np.ndarray:
        """``states`` of ``texts`` (see ``text_ids``): the embedding the server's
        engine embedder returns for each."""
        return self.states([self.text_ids(text) for text in texts], on_state)

    def metric_total(self, name: str) -> float:
        """The engine's metric ``name`` summed over its labels (``vllm:num_preemptions``)."""
        return _vllm().metric_total(self.llm, name)

    def states(self, prompts: Sequence[Sequence[int]], on_state: Callable[[int], None] | None = None) -> np.ndarray:
        """Final-norm last-token states of ``prompts`` (token ids), ``[n, d]``
        float32, from one ``LLM.generate`` call (``max_tokens=1``) in the given
        order. A state the channel lost is asked for again once."""
        records = self.records(prompts, on_state)
        if not records:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([r.hidden_state() for r in records]).astype(np.float32)

    def records(
        self,
        prompts: Sequence[Sequence[int]],
        on_state: Callable[[int], None] | None = None,
        *,
        attempts: int = 2,
        **sampling: Any,
    ) -> list[Any]:
        """The capture records of ``prompts``, in order (see ``states``).
        ``attempts``: generate calls for states the channel lost (1: a lost
        state is an error); ``sampling``: ``SamplingParams`` fields besides the
        greedy single token (``max_tokens=4`` lets requests decode after the
        captured prefill). A prompt captured twice is an error."""
        if self.llm is None:
            raise CaptureError("the engine is closed")
        records: list[Any] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for _attempt in range(attempts):
            if not todo:
                break
            self._run([prompts[i] for i in todo], todo, records, on_state, sampling)
            todo = [i for i in todo if records[i] is None]
        if todo:
            raise CaptureError(f"no state was captured for {len(todo)} of {len(prompts)} prompts")
        for i, record in enumerate(records):
            if record.num_prompt_tokens != len(prompts[i]):
                raise CaptureError(
                    f"prompt {i}: the engine saw {record.num_prompt_tokens} tokens, {len(prompts[i])} were sent"
                )
            if self.layers and record.layer_tokens != len(prompts[i]):
                raise CaptureError(f"prompt {i}: layer taps averaged {record.layer_tokens} of {len(prompts[i])} tokens")
        return records

    def _run(self, prompts, slots, records, on_state, sampling) -> None:
        self._batches += 1
        batch = f"extract-{self._nonce}-{self._batches}-"
        keys = [f"{batch}{n}" for n in range(len(prompts))]
        pending = dict(zip(keys, slots))
        twice: list[str] = []
        generated, stop = threading.Event(), threading.Event()
        channel = self._receiver
        if channel is None:
            raise CaptureError("the engine is closed")

        def receive() -> None:
            # until the batch is generated, every state came and the channel is
            # quiet: a request captured twice (at a later step) is seen too
            while not stop.is_set():
                record = channel.receive(50)
                if record is None:
                    if generated.is_set() and not pending:
                        return
                    continue
                if record.key is None or not record.key.startswith(batch):
                    continue  # not ours, or from an earlier attempt
                slot = pending.pop(record.key, None)
                if slot is None:
                    twice.append(record.key)
                    continue
                records[slot] = record
                if on_state is not None:
                    on_state(slot)

        receiver = threading.Thread(target=receive, name="pamer-extract-receiver", daemon=True)
        receiver.start()
        try:
            _vllm().generate_captures(self.llm, prompts, [{CAPTURE_KEY: key} for key in keys], **sampling)
            generated.set()
            receiver.join(self.capture_timeout_s)  # records still in flight
        finally:
            stop.set()
            receiver.join()
        if twice:
            raise CaptureError(f"{len(set(twice))} of {len(prompts)} prompts were captured more than once")

    def _close_socket(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        try:
            os.unlink(os.path.join(self._dir, "capture.sock"))
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass

    def close(self) -> None:
        """Shut the engine down now (not at interpreter exit) and free the channel."""
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                _vllm().shutdown(llm)
        finally:
            self._close_socket()

    def __enter__(self) -> CaptureEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
