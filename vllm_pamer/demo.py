"""``vllm-pamer demo``: serve the embedded default model with the plugin and
replay one real multi-turn trajectory through it, printing per step what the
plugin saw and did.

The demo uses the trained heads that ship for the embedded model; without
them (a build that lacks the file) it uses untrained random heads, clearly
labelled: their logits are real computations on real states, without meaning.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from vllm_pamer.default_model import DEFAULT_MODEL_NAME, cache_root, ensure_default_model, shipped_heads
from vllm_pamer.server_process import ServerProcess
from vllm_pamer.trajectories import agent_requests, load_trajectories


def demo_heads_path() -> Path:
    return cache_root() / "heads" / f"{DEFAULT_MODEL_NAME}-random-seed0.safetensors"


def ensure_demo_heads(model_dir: Path) -> Path:
    path = demo_heads_path()
    if not path.exists():
        from vllm_pamer.core.heads import random_heads, save_heads
        from vllm_pamer.model_config import model_fingerprint

        fingerprint = model_fingerprint(model_dir, DEFAULT_MODEL_NAME)
        save_heads(random_heads(fingerprint, seed=0), path)
    return path


def _fmt_logits(logits) -> str:
    return "[" + " ".join(f"{v:+.2f}" for v in logits) + "]" if logits else "-"


def replay(base_url: str, model: str, trajectory: dict, session_id: str, max_steps: int | None, max_tokens: int):
    """Send each of the agent's requests of ``trajectory``; yield (step, pamer)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    for step, (_, history) in enumerate(agent_requests(trajectory["messages"])):
        if max_steps is not None and step >= max_steps:
            break
        response = client.chat.completions.create(
            model=model,
            messages=history,  # type: ignore[arg-type]  # OpenAI's message TypedDicts
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"X-Session-ID": session_id},
        )
        yield step, len(history), response


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-pamer demo", description=__doc__)
    parser.add_argument("--policy", default=None, help="default: pamer with the shipped heads, else recent_k")
    parser.add_argument("--trajectory", default="airline-task14-trial1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--context-budget",
        type=int,
        default=DEMO_BUDGET,
        help="PaMER's context budget in tokens (default %(default)s: small, so this short trajectory compacts)",
    )
    args = parser.parse_args(argv)

    model_dir = ensure_default_model()
    heads = shipped_heads()
    if heads is not None:
        about = "trained for this model, shipped in the package"
    else:
        heads, about = ensure_demo_heads(model_dir), "UNTRAINED random heads: logits are real, meaning is not"
    args.policy = args.policy or ("pamer" if shipped_heads() else "recent_k")
    trajectories = {t["id"]: t for t in load_trajectories(kind="tau")}
    trajectory = trajectories[args.trajectory]
    log_path = cache_root() / "demo-server.log"
    print(f"model: {model_dir}\nheads: {heads} ({about})")
    print(f"policy: {args.policy}; trajectory {trajectory['id']} ({len(trajectory['messages'])} messages)")
    print(f"server log: {log_path}")

    # --enforce-eager: torch.compile of the model costs over a minute on two
    # cores at first start and buys little for a 135M model.
    serve_args = ["--pamer-policy", args.policy, "--pamer-heads", str(heads), "--enforce-eager"]
    serve_args += ["--enable-prompt-tokens-details"]  # cached tokens per response
    if args.policy == "pamer":  # summaries of at most 256 tokens keep the CPU demo to minutes
        options = {"summary_max_tokens": 256, "context_budget": args.context_budget}
        serve_args += ["--pamer-policy-options", json.dumps(options)]
    # Memories persist in the SQLite store across server restarts: a fresh
    # session id per run, so a second demo does not start with the first one's.
    session_id = f"demo-{trajectory['id']}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"session: {session_id}")
    server = ServerProcess(serve_args, args.port, log_path)
    try:
        server.wait_ready()
        _print_replay(server, trajectory, session_id, args)
    finally:
        server.stop()


DEMO_BUDGET = 3500
HEADER = (
    f"{'step':>4} {'msgs':>4} {'tok in':>6} {'tok out':>7} {'cached':>6} {'capt':>4}  "
    f"{'head logits':<37} {'votes':>5} {'vote':>5}  action"
)


def _print_replay(server: ServerProcess, trajectory: dict[str, Any], session_id: str, args: Any) -> None:
    total_in = total_out = total_cached = captured = steps = 0
    for step, n_messages, response in replay(
        server.base_url, DEFAULT_MODEL_NAME, trajectory, session_id, args.max_steps, args.max_tokens
    ):
        p = response.model_extra["pamer"]
        if steps == 0:
            if p.get("schedule"):
                sched = p["schedule"]
                print(
                    f"schedule: budget {sched['budget']} tokens, band from {sched['band_low']}, "
                    f"a compaction goes down to {sched['target']}"
                )
            print(HEADER + "\n" + "-" * len(HEADER))
        details = response.usage.prompt_tokens_details if response.usage else None
        cached = (details.cached_tokens or 0) if details is not None else 0
        action = p["action"]
        sched = p.get("schedule") or {}
        if sched.get("trigger"):
            action += f" ({sched['trigger']}, {sched['cache_break_tokens']} cached tokens recomputed)"
        if p.get("recalled"):
            action += f" memories {p['recalled']}"
        votes = p["votes"] if p["votes"] is not None else "-"
        vote = str(p["compress_vote"]) if p["compress_vote"] is not None else "-"
        print(
            f"{step:>4} {n_messages:>4} {p['prompt_tokens_in']:>6} {p['prompt_tokens_out']:>7} {cached:>6} "
            f"{'yes' if p['captured'] else 'no':>4}  {_fmt_logits(p['head_logits']):<37} {votes:>5} {vote:>5}  {action}"
        )
        total_in += p["prompt_tokens_in"] or 0
        total_out += p["prompt_tokens_out"] or 0
        total_cached += cached
        captured += bool(p["captured"])
        steps += 1
    print("-" * len(HEADER))
    print(
        f"{steps} requests, {captured} states captured; prompt tokens {total_in} -> {total_out} "
        f"({100.0 * total_out / max(total_in, 1):.0f}% sent), {100.0 * total_cached / max(total_out, 1):.0f}% "
        f"of them from the prefix cache, with policy {args.policy}"
    )


if __name__ == "__main__":
    main()
