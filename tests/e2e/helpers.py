"""Shared pieces of the end-to-end tests."""

from __future__ import annotations

import socket

from vllm_pamer.default_model import DEFAULT_MODEL_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(client, messages, session=None, policy=None, max_tokens=8, **kwargs):
    """One chat request as an agent sends it, asking the server to echo what it sent."""
    headers = {"X-Pamer-Echo": "1"}
    if session:
        headers["X-Session-ID"] = session
    if policy:
        headers["X-Pamer-Policy"] = policy
    return client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_headers=headers, **kwargs,
    )
