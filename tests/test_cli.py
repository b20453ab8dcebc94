"""The command table (``vllm_pamer/cli.py``): every command is a function of its module and in the usage."""

from __future__ import annotations

import importlib

from vllm_pamer import cli


def test_every_command_is_a_function_of_its_module_and_in_the_usage():
    for name, target in cli.COMMANDS.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name
        assert f"vllm-pamer {name} " in cli.__doc__, name
