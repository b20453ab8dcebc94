"""Everything of vLLM this adapter package reads, as data: one entry per
module-level class or function, with the names it must still hold (its
methods, fields, ``self.`` attributes, parameters, the calls and strings in its
body). The facts recorded from each series' wheel sit beside this file
(``touch_points.json``); after changing an entry, re-record them with
``python -m vllm_pamer.adapters.touch_facts`` (``adapters/touch_facts.py``).
"""

from __future__ import annotations

from vllm_pamer.adapters.touch_facts import TouchPoint

TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # -- registration.py / models.py: every architecture resolved to a capturing class
    TouchPoint(
        "model_executor/models/registry.py", "_ModelRegistry.resolve_model_cls", ("architectures", "model_config")
    ),
    TouchPoint(
        "config/model.py", "ModelConfig", ("runner_type", "hf_config", "served_model_name", "max_model_len", "dtype")
    ),
    TouchPoint(
        "config/vllm.py", "VllmConfig", ("use_v2_model_runner", "model_config", "device_config", "parallel_config")
    ),
    TouchPoint("config/parallel.py", "ParallelConfig", ("enable_batch_sharded_sampling", "worker_extension_cls")),
    TouchPoint("distributed/parallel_state.py", "get_pp_group"),
    TouchPoint("distributed/parallel_state.py", "get_tensor_model_parallel_rank"),
    TouchPoint("plugins/__init__.py", "", ("vllm.general_plugins",)),
    # -- worker_v1.py: the V1 runner's step
    TouchPoint(
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner.execute_model",
        ("scheduler_output", "compute_logits"),
        "the sampling call happens inside the bracket",
    ),
    TouchPoint("v1/worker/gpu_model_runner.py", "GPUModelRunner", ("input_batch", "requests")),
    TouchPoint(
        "v1/worker/gpu_input_batch.py", "InputBatch", ("req_ids", "num_computed_tokens_cpu", "num_prompt_tokens")
    ),
    TouchPoint("v1/worker/gpu_input_batch.py", "CachedRequestState", ("sampling_params",)),
    TouchPoint(
        "v1/core/sched/output.py",
        "SchedulerOutput",
        (
            "num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "finished_req_ids",
            "preempted_req_ids",
            "scheduled_new_reqs",
        ),
    ),
    TouchPoint("v1/core/sched/output.py", "NewRequestData", ("req_id", "sampling_params")),
    # -- worker_v2.py: Model Runner V2
    TouchPoint(
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner.sample",
        ("hidden_states", "input_batch", "compute_logits", "logits_indices", "batch_sharder"),
        "hands compute_logits hidden_states[input_batch.logits_indices]",
    ),
    TouchPoint(
        "v1/worker/gpu/model_runner.py", "GPUModelRunner.add_requests", ("scheduled_new_reqs", "sampling_params")
    ),
    TouchPoint(
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner.finish_requests",
        ("finished_req_ids", "preempted_req_ids"),
    ),
    TouchPoint("v1/worker/gpu/model_runner.py", "GPUModelRunner", ("req_states", "adaptive_verification")),
    TouchPoint(
        "v1/worker/gpu/input_batch.py",
        "InputBatch",
        (
            "req_ids",
            "num_reqs",
            "num_scheduled_tokens",
            "num_computed_tokens_np",
            "idx_mapping_np",
            "cu_num_logits",
            "cu_num_logits_np",
            "num_draft_tokens",
            "logits_indices",
        ),
    ),
    TouchPoint("v1/worker/gpu/states.py", "RequestState", ("prompt_len",)),
    # -- the worker extension (worker/extension.py), reached by collective_rpc
    TouchPoint("v1/worker/worker_base.py", "WorkerWrapperBase", ("worker_extension_cls",)),
    TouchPoint("engine/protocol.py", "EngineClient.collective_rpc", ("method", "timeout", "args")),
    # -- serving.py: the API server
    TouchPoint(
        "sampling_params.py", "SamplingParams", ("extra_args", "max_tokens", "temperature", "structured_outputs")
    ),
    TouchPoint("sampling_params.py", "StructuredOutputsParams", ("json", "disable_any_whitespace")),
    TouchPoint("entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", ("messages", "tools")),
    TouchPoint("entrypoints/openai/chat_completion/protocol.py", "ChatCompletionToolsParam"),
    TouchPoint("entrypoints/serve/engine/protocol.py", "ErrorResponse"),
    # -- serving.py: the Anthropic Messages API (server/apis.py)
    TouchPoint(
        "entrypoints/anthropic/serving.py",
        "AnthropicServingMessages",
        ("to_chat_completion_request", "create_messages", "_merge_inline_system"),
    ),
    TouchPoint(
        "entrypoints/anthropic/serving.py",
        "AnthropicServingMessages.create_messages",
        ("request", "raw_request", "to_chat_completion_request", "create_chat_completion"),
    ),
    TouchPoint(
        "entrypoints/anthropic/serving.py",
        "AnthropicServingMessages.to_chat_completion_request",
        ("anthropic_request", "merge_inline_system"),
    ),
    TouchPoint("entrypoints/anthropic/protocol.py", "AnthropicMessagesRequest", ("messages", "max_tokens", "thinking")),
    TouchPoint("entrypoints/anthropic/protocol.py", "AnthropicMessagesResponse"),
    TouchPoint("entrypoints/anthropic/protocol.py", "AnthropicErrorResponse", ("error",)),
    TouchPoint("entrypoints/anthropic/protocol.py", "AnthropicError", ("type", "message")),
    TouchPoint("entrypoints/anthropic/api_router.py", "messages", ("anthropic_serving_messages",)),
    # -- serving.py: the Responses API (server/responses.py)
    TouchPoint(
        "entrypoints/openai/responses/protocol.py",
        "ResponsesRequest",
        ("input", "instructions", "previous_response_id", "store", "vllm_xargs", "max_output_tokens"),
    ),
    TouchPoint("entrypoints/openai/responses/protocol.py", "ResponsesResponse", ("output", "status")),
    TouchPoint(
        "entrypoints/openai/responses/utils.py",
        "construct_input_messages",
        ("request_instructions", "request_input", "prev_msg", "prev_response_output"),
    ),
    TouchPoint("entrypoints/openai/responses/utils.py", "construct_chat_messages_with_tool_call"),
    TouchPoint(
        "entrypoints/openai/responses/serving.py",
        "OpenAIServingResponses.create_responses",
        ("request", "raw_request"),
    ),
    TouchPoint("entrypoints/openai/responses/api_router.py", "responses", ("openai_serving_responses",)),
    TouchPoint("entrypoints/serve/middleware/authenticate.py", "AuthenticationMiddleware.verify_token"),
    TouchPoint("entrypoints/serve/utils/api_utils.py", "with_cancellation", ("raw_request",)),
    TouchPoint("exceptions.py", "VLLMClientError"),
    TouchPoint("envs.py", "", ("VLLM_API_KEY",)),
    TouchPoint("config/cache.py", "CacheConfig", ("num_gpu_blocks", "block_size")),
    TouchPoint("v1/metrics/loggers.py", "", ("vllm:kv_cache_usage_perc",)),
    # -- offline.py and cpu.py
    TouchPoint("entrypoints/llm.py", "LLM.generate", ("prompts", "sampling_params", "use_tqdm")),
    TouchPoint("entrypoints/llm.py", "LLM.__init__", ("llm_engine",)),
    TouchPoint("entrypoints/llm.py", "LLM.get_tokenizer"),
    TouchPoint("entrypoints/llm.py", "LLM.get_metrics"),
    TouchPoint("v1/engine/llm_engine.py", "LLMEngine.__init__", ("model_config", "engine_core")),
    TouchPoint("v1/engine/core_client.py", "EngineCoreClient.shutdown"),
    TouchPoint("inputs/llm.py", "TokensPrompt", ("prompt_token_ids",)),
    TouchPoint("sampling_params.py", "SamplingParams", ("detokenize",)),
    TouchPoint("v1/metrics/reader.py", "Counter", ("value",)),
    TouchPoint("v1/metrics/reader.py", "Metric", ("name",)),
    TouchPoint("entrypoints/cli/main.py", "main"),
)
