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
import json
import os
import sys
from pathlib import Path

from vllm_pamer.config import PamerConfig
from vllm_pamer.plugin import PLUGIN_NAMES
from vllm_pamer.vllm_cpu import is_cpu_build, prepare_vllm_cpu


def _enable_plugins(env: dict[str, str]) -> None:
    wanted = PLUGIN_NAMES.split(",")
    current = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    env["VLLM_PLUGINS"] = ",".join(current + [p for p in wanted if p not in current])


def _run_vllm_cli(argv: list[str]) -> None:
    """Run vLLM's own CLI in this process (see vllm_pamer.vllm_cpu)."""
    prepare_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


def _model_fingerprint(model: str):
    from vllm_pamer.core.heads import ModelFingerprint

    return ModelFingerprint.from_model_dir(model)


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def cmd_serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="vllm-pamer serve", add_help=False)
    parser.add_argument("--pamer-policy", default=None)
    parser.add_argument("--pamer-policy-options", default=None, help="JSON object of policy options")
    parser.add_argument("--pamer-options-by-policy", default=None,
                        help='JSON: options of policies requests choose, e.g. {"sam": {"page_tokens": 1024}}')
    parser.add_argument("--pamer-heads", default=None, help="heads file (safetensors)")
    parser.add_argument("--pamer-embedder", default=None, help="served (default) or minilm")
    parser.add_argument("--pamer-no-capture", action="store_true")
    parser.add_argument("--pamer-off", action="store_true",
                        help="plain vLLM: the same model and flags without the plugin (A/B baselines)")
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        print("Plugin flags: --pamer-policy NAME, --pamer-policy-options JSON, --pamer-options-by-policy JSON, "
              "--pamer-heads PATH, "
              "--pamer-embedder served|minilm, --pamer-no-capture")
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

    config = PamerConfig.from_env()
    overrides = {}
    if ours.pamer_policy:
        overrides["policy"] = ours.pamer_policy
    if ours.pamer_policy_options:
        overrides["policy_options"] = json.loads(ours.pamer_policy_options)
    if ours.pamer_options_by_policy:
        overrides["options_by_policy"] = json.loads(ours.pamer_options_by_policy)
    if ours.pamer_heads:
        overrides["heads"] = str(Path(ours.pamer_heads).resolve())
    if ours.pamer_embedder:
        overrides["embedder"] = ours.pamer_embedder
    if ours.pamer_no_capture:
        overrides["capture"] = False
    import msgspec

    config = msgspec.structs.replace(config, **overrides)
    if config.heads is None and shipped is not None and config.capture:
        config = msgspec.structs.replace(config, heads=str(shipped))

    # Fail fast, before the engine spends a minute starting.
    try:
        cls = policy_class(config.default_policy)
        create_policy(config.default_policy, config.policy_options)  # bad options: an error now
        for name, options in config.options_by_policy.items():
            create_variant(name, options)
        if config.heads:
            load_heads(config.heads).check_model(_model_fingerprint(model), config.heads)
        elif cls.requires_heads:
            raise UnknownPolicy(
                f"policy {config.default_policy!r} needs heads trained for {model}; pass --pamer-heads "
                "(or pick a policy that needs none: none, recent_k)"
            )
        if config.embedder != "served":
            from vllm_pamer.embedders import make_embedder

            make_embedder(config.embedder, check=True)
    except (UnknownPolicy, HeadsMismatch, ValueError, FileNotFoundError, RuntimeError) as exc:
        sys.exit(f"vllm-pamer: {exc}")

    if ours.pamer_off:  # no plugin is loaded at all, so nothing of ours runs
        os.environ["VLLM_PLUGINS"] = ""
        _run_vllm_cli(["serve", model, *_cpu_defaults(rest)])
        return
    os.environ.update(config.to_env())
    _enable_plugins(os.environ)
    _run_vllm_cli(["serve", model, *_cpu_defaults(rest)])


def _cpu_defaults(rest: list[str]) -> list[str]:
    if is_cpu_build() and not _has_flag(rest, "--gpu-memory-utilization"):
        # On CPU this is the share of RAM reserved for the KV cache.
        rest = rest + ["--gpu-memory-utilization", "0.2"]
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
        "--constant-logit", type=float, default=None,
        help="heads that ignore the state and always output this logit (e.g. 10 forces 'compress', -10 'keep'); for tests",
    )
    args = parser.parse_args(argv)
    from vllm_pamer.core.heads import constant_heads, random_heads, save_heads
    from vllm_pamer.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    fingerprint = _model_fingerprint(model)
    if args.constant_logit is None:
        save_heads(random_heads(fingerprint, seed=args.seed), args.out)
        print(f"wrote untrained random heads for {model} to {args.out}")
    else:
        save_heads(constant_heads(fingerprint, args.constant_logit), args.out)
        print(f"wrote constant-logit ({args.constant_logit}) heads for {model} to {args.out}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "serve": cmd_serve,
        "prepare-model": cmd_prepare_model,
        "make-heads": cmd_make_heads,
    }
    if argv and argv[0] == "demo":
        from vllm_pamer.demo import main as demo_main

        return demo_main(argv[1:])
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


if __name__ == "__main__":
    main()
