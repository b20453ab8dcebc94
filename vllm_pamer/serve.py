"""``vllm-pamer serve [MODEL] [--pamer-... flags] [vLLM serve flags]``: the
plugin's settings checked before the engine starts (the policy and its
options, the heads against the model, the embedder), then vLLM's own ``serve``
with the plugin enabled. Without MODEL: the embedded default model with its
shipped trained heads. ``--pamer-off``: plain vLLM, same model and flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableMapping

import msgspec

from vllm_pamer.adapters.launch import cpu_default_dtype, is_cpu_build, run_vllm_cli
from vllm_pamer.channel import WORKER_EXTENSION
from vllm_pamer.model_config import model_fingerprint
from vllm_pamer.plugin import PLUGIN_NAMES
from vllm_pamer.settings import Settings


def _enable_plugins(env: MutableMapping[str, str]) -> None:
    wanted = PLUGIN_NAMES.split(",")
    current = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(current + [p for p in wanted if p not in current])


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="vllm-pamer serve", add_help=False)
    Settings.add_flags(parser)
    parser.add_argument(
        "--pamer-off",
        action="store_true",
        help="plain vLLM: the same model and flags without the plugin (A/B baselines)",
    )
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        print("Plugin flags (each also a PAMER_<NAME> variable):")
        print(parser.format_help().split("\n", 2)[-1])
        print("Every other flag is vLLM's (vllm serve --help).\n")
    model = rest.pop(0) if rest and not rest[0].startswith("-") else None
    shipped = None
    if model is None:
        from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model, shipped_heads

        model = str(ensure_default_model())
        shipped = shipped_heads()  # the embedded model's trained heads: PaMER out of the box
        if not _has_flag(rest, "--served-model-name"):
            rest += ["--served-model-name", DEFAULT_MODEL_NAME]
        if not _has_flag(rest, "--tool-call-parser"):
            # SmolLM2's template knows no tools: the server writes calls as
            # <tool_call>{json}</tool_call> text (core/render.py), the format
            # vLLM's hermes parser reads back into OpenAI tool_calls.
            rest += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

    from vllm_pamer.core.heads import HeadsMismatch, load_heads
    from vllm_pamer.core.policies import UnknownPolicy, create_policy, create_variant, policy_class

    try:
        settings = Settings.from_env().with_flags(ours)
        if settings.heads is None and shipped is not None and settings.capture:
            settings = msgspec.structs.replace(settings, heads=str(shipped))
        # Fail fast, before the engine spends a minute starting.
        cls = policy_class(settings.default_policy)
        create_policy(settings.default_policy, settings.policy_options)  # bad options: an error now
        for name, options in settings.options_by_policy.items():
            create_variant(name, options)
        if settings.heads:
            load_heads(settings.heads).check_model(model_fingerprint(model), settings.heads)
        elif cls.requires_heads:
            raise UnknownPolicy(
                f"policy {settings.default_policy!r} needs heads trained for {model}; pass --pamer-heads "
                "(or pick a policy that needs none: none, recent_k)"
            )
        if settings.embedder != "served":
            from vllm_pamer.embedders import make_embedder

            make_embedder(settings.embedder, check=True)
    except (UnknownPolicy, HeadsMismatch, ValueError, FileNotFoundError, RuntimeError) as exc:
        sys.exit(f"vllm-pamer: {exc}")

    if ours.pamer_off:  # no plugin is loaded at all, so nothing of ours runs
        os.environ["VLLM_PLUGINS"] = ""
        run_vllm_cli(["serve", model, *_cpu_defaults(rest)])
        return
    os.environ.update(settings.to_env())
    _enable_plugins(os.environ)
    if settings.memory_rows and not _has_flag(rest, "--worker-extension-cls"):
        rest += ["--worker-extension-cls", WORKER_EXTENSION]  # recall in the worker (worker/memory.py)
    run_vllm_cli(["serve", model, *_cpu_defaults(rest)])


def _cpu_defaults(rest: list[str]) -> list[str]:
    if is_cpu_build() and not _has_flag(rest, "--gpu-memory-utilization"):
        # On CPU this is the share of RAM reserved for the KV cache.
        rest = rest + ["--gpu-memory-utilization", "0.2"]
    dtype = cpu_default_dtype()
    if dtype and not _has_flag(rest, "--dtype"):
        print(f"vllm-pamer: this CPU has no native bf16: serving in {dtype} (pass --dtype to choose)", file=sys.stderr)
        rest = rest + ["--dtype", dtype]
    return rest
