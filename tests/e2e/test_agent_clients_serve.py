"""End to end: the agent clients people use, unchanged but for a session id,
against a real ``vllm-pamer serve`` of the default model: litellm (chat,
streamed, and its ``responses()``), the OpenAI Agents SDK (its default
Responses model and its chat completions model, a tool offered) and
mini-swe-agent (a few steps of its loop). Each session is read back from the
server (``GET /pamer/sessions/{id}``): every request the client sent was
managed, none broke the tool protocol."""

from __future__ import annotations

import os
import platform

import httpx
import pytest

from vllm_pamer.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.e2e

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches prices from the web otherwise
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")  # a local model has no price
LITELLM_MODEL = f"hosted_vllm/{DEFAULT_MODEL_NAME}"
TASK = "Find the file that defines the reservation model and print its first line."


def session(server, name):
    """The server's view of session ``name``."""
    response = httpx.get(f"{server.base_url}/pamer/sessions/{name}", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def managed(server, name, at_least):
    """Session ``name`` saw ``at_least`` requests, each managed (no protocol fallback)."""
    state = session(server, name)
    assert state["requests"] >= at_least, state
    broken = ("unsafe_tool_protocol", "invalid_rewrite")
    assert not any(rule in str(e) for e in state["events"] for rule in broken), state["events"]
    assert not any(rule in str(state["last_action"]) for rule in broken), state
    return state


def test_litellm_chat_and_stream_carry_the_session_and_show_the_report(compress_server):
    import litellm

    messages = [{"role": "system", "content": "You book flights."}, {"role": "user", "content": "Cancel H9ZU1C."}]
    common = {
        "model": LITELLM_MODEL,
        "api_base": f"{compress_server.base_url}/v1",
        "api_key": "unused",
        "max_tokens": 8,
        "extra_headers": {"X-Session-ID": "litellm-e2e"},
    }
    answer = litellm.completion(messages=messages, **common)
    headers = answer._hidden_params["additional_headers"]
    assert headers["llm_provider-x-pamer-session"] == "litellm-e2e"  # litellm keeps the headers
    stream = litellm.completion(messages=[*messages, {"role": "user", "content": "Now."}], stream=True, **common)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) is not None
    assert stream._hidden_params["additional_headers"]["llm_provider-x-pamer-action"]
    managed(compress_server, "litellm-e2e", 2)


def test_litellm_responses_carries_the_session(compress_server):
    import litellm

    litellm.responses(
        model=LITELLM_MODEL,
        input="Cancel H9ZU1C.",
        api_base=f"{compress_server.base_url}/v1",
        api_key="unused",
        max_output_tokens=8,
        extra_headers={"X-Session-ID": "litellm-responses-e2e"},
    )
    managed(compress_server, "litellm-responses-e2e", 1)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_the_openai_agents_sdk_runs_its_loop_on_the_memory(compress_server, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
    )
    from agents.exceptions import AgentsException
    from openai import AsyncOpenAI

    @function_tool
    def get_reservation(reservation_id: str) -> str:
        """The reservation's status."""
        return f"{reservation_id}: active, refundable"

    name = f"agents-{api}-e2e"
    client = AsyncOpenAI(base_url=f"{compress_server.base_url}/v1", api_key="unused", max_retries=0)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="travel",
        instructions="You book flights. Use get_reservation to look reservations up.",
        tools=[get_reservation],
        model=model_class(DEFAULT_MODEL_NAME, client),
        model_settings=ModelSettings(max_tokens=24, temperature=0, extra_headers={"X-Session-ID": name}),
    )
    try:
        Runner.run_sync(agent, "Is H9ZU1C refundable?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    except AgentsException:  # a 135M model may loop on its tool past max_turns: the requests were served
        pass
    managed(compress_server, name, 1)


class RecordingEnvironment:
    """mini-swe-agent's environment, recording the commands the model asks
    for instead of running a small model's commands on this machine."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        self.commands.append(str(action.get("command", action)))
        return {"output": "src/models/reservation.py\n", "returncode": 0, "exception_info": ""}

    def get_template_vars(self, **kwargs) -> dict:
        return {"cwd": "/repo", **platform.uname()._asdict(), **kwargs}  # as its local environment

    def serialize(self) -> dict:
        return {}


def test_mini_swe_agent_runs_a_few_steps_on_the_memory(compress_server):
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())
    model = LitellmModel(
        model_name=LITELLM_MODEL,
        model_kwargs={
            "api_base": f"{compress_server.base_url}/v1",
            "api_key": "unused",
            "max_tokens": 24,
            "temperature": 0,
            "extra_headers": {"X-Session-ID": "mini-swe-e2e"},
        },
        cost_tracking="ignore_errors",
    )
    agent_config = {**config["agent"], "step_limit": 4, "cost_limit": 0, "max_consecutive_format_errors": 0}
    agent = DefaultAgent(model, RecordingEnvironment(), **agent_config)
    result = agent.run(TASK)
    assert result.get("exit_status") in ("LimitsExceeded", "Submitted"), result
    managed(compress_server, "mini-swe-e2e", 2)
