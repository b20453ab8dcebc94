"""``vllm-pamer`` command line.

vllm-pamer serve [MODEL] [--pamer-policy NAME] [--pamer-heads PATH] [vLLM serve args]
vllm-pamer prepare-model            convert the embedded default model (once)
vllm-pamer make-heads --out PATH    write random (untrained) heads for a model
vllm-pamer demo                     serve the default model and replay a trajectory
vllm-pamer annotate --out PATH [--data PATH ...]   label decision points (recall/compression)
vllm-pamer extract --labels PATH --out DIR [--data PATH ...] [--limit N]   states on the engine
vllm-pamer train --states DIR --out PATH [--report DIR] [--target compression|recall]
                 [--head mlp|linear] [--export full|student] [--texts JSONL | --trajectories PATH ...]
vllm-pamer replay --out DIR [--url URL] [--data PATH ...] [--policies none,recent_k] [--concurrency N]
                  [--limit-trajectories N] [--max-steps N] [--max-tokens N]   policies against a server
vllm-pamer replay --frontier [--data PATH ...]   recent_k's evidence frontier, offline
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


def cmd_serve(argv: list[str]) -> None:
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


def cmd_prepare_model(argv: list[str]) -> None:
    from vllm_pamer.default_model import ensure_default_model

    print(ensure_default_model())


def cmd_make_heads(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="vllm-pamer make-heads")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--constant-logit",
        type=float,
        default=None,
        help="heads that ignore the state and always output this logit "
        "(e.g. 10 forces 'compress', -10 'keep'); for tests",
    )
    args = parser.parse_args(argv)
    from vllm_pamer.core.heads import constant_heads, random_heads, save_heads
    from vllm_pamer.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    fingerprint = model_fingerprint(model)
    if args.constant_logit is None:
        save_heads(random_heads(fingerprint, seed=args.seed), args.out)
        print(f"wrote untrained random heads for {model} to {args.out}")
    else:
        save_heads(constant_heads(fingerprint, args.constant_logit), args.out)
        print(f"wrote constant-logit ({args.constant_logit}) heads for {model} to {args.out}")


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "serve": cmd_serve,
        "prepare-model": cmd_prepare_model,
        "make-heads": cmd_make_heads,
    }
    if argv and argv[0] == "demo":
        from vllm_pamer.demo import main as demo_main

        demo_main(argv[1:])
        return 0
    if argv and argv[0] == "annotate":
        from vllm_pamer.training.cli import annotate_main

        return annotate_main(argv[1:])
    if argv and argv[0] == "extract":
        from vllm_pamer.training.cli import extract_main

        return extract_main(argv[1:])
    if argv and argv[0] == "train":
        from vllm_pamer.training.cli import train_main

        return train_main(argv[1:])
    if argv and argv[0] == "replay":
        from vllm_pamer.replay.cli import main as replay_main

        return replay_main(argv[1:])
    if not argv or argv[0] not in commands:
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
