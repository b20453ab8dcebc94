"""``vllm-pamer make-heads --out PATH``: heads for a model that were never
trained, random or with one constant logit (tests and demos)."""

from __future__ import annotations

import argparse

from vllm_pamer.model_config import model_fingerprint


def main(argv: list[str]) -> None:
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
