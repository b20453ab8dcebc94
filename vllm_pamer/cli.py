"""``vllm-pamer`` command line.

vllm-pamer serve [MODEL] [--pamer-policy NAME] [--pamer-heads PATH] [vLLM serve args]
vllm-pamer prepare-model            convert the embedded default model (once)
vllm-pamer make-heads --out PATH    write random (untrained) heads for a model
vllm-pamer demo                     serve the default model and replay a trajectory
vllm-pamer annotate --out PATH [--data PATH ...]   label decision points (recall/compression)
vllm-pamer extract --labels PATH --out DIR [--data PATH ...] [--limit N]   states on the engine
vllm-pamer train --states DIR --out PATH [--report DIR] [--target compression|recall]
                 [--head mlp|linear] [--export full|student] [--texts JSONL | --trajectories PATH ...]
vllm-pamer train-control --labels PATH --data PATH ...   the metadata control as the band's trigger
vllm-pamer replay --out DIR [--url URL] [--data PATH ...] [--policies none,recent_k] [--concurrency N]
                  [--limit-trajectories N] [--max-steps N] [--max-tokens N]   policies against a server
vllm-pamer replay --serve --group-size N --out DIR [--stop-after-min MIN] [...]   on its own server, resumable
vllm-pamer replay --frontier [--data PATH ...]   recent_k's evidence frontier, offline

Each command is one module's function (``COMMANDS``); ``vllm-pamer COMMAND --help`` for its options.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": "vllm_pamer.serve:main",
    "prepare-model": "vllm_pamer.default_model:main",
    "make-heads": "vllm_pamer.make_heads:main",
    "demo": "vllm_pamer.demo:main",
    "annotate": "vllm_pamer.training.cli:annotate_main",
    "extract": "vllm_pamer.training.cli:extract_main",
    "train": "vllm_pamer.training.cli:train_main",
    "train-control": "vllm_pamer.training.cli:train_control_main",
    "replay": "vllm_pamer.replay.cli:main",
}
"""Each command's ``module:function``, imported only when it runs: a command
loads what it needs and no other command's imports."""


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module, function = COMMANDS[argv[0]].split(":")
    result = getattr(importlib.import_module(module), function)(argv[1:])
    return 0 if result is None else result


if __name__ == "__main__":
    sys.exit(main())
