"""Replay harness: recorded agent trajectories against a running
vllm-pamer server, one policy at a time, with what each policy cost and kept.

* ``evidence``: which values the next action needs and whether a rewritten
  context still holds them (pure); the offline recent_k frontier;
* ``client``: the async replay (sessions, echo, /metrics deltas, KV peak);
* ``records``: the per-request and per-run records;
* ``prometheus``: reading /metrics;
* ``report``: the per-policy table and JSON; ``plots``: its plots;
* ``sittings``: a benchmark spread over sittings (groups, resumable units);
* ``ab``: interleaved A/B rounds on fresh servers;
* ``cli``: ``vllm-pamer replay``.
"""
