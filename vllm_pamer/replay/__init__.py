"""Replay harness: recorded agent trajectories against a running
vllm-pamer server, one policy at a time, with what each policy cost and kept.

* ``evidence``: which values the next action needs and whether a rewritten
  context still holds them (pure); the offline recent_k frontier;
* ``client``: the async replay (sessions, echo, /metrics deltas, KV peak);
* ``records``: the per-request, per-run and per-policy records;
* ``prometheus``: reading /metrics;
* ``report``: the per-policy table and JSON; ``plots``: its plots;
  ``readings``: the rows' evidence by the one rule on common requests, and
  their next-action likelihood against the full history and recency;
* ``likelihood``: the recorded next action scored given what a policy sent;
* ``runs``: a resumable run over sittings (groups, saved units, the settings
  a resume repeats); ``run_report``: its report over the finished groups;
* ``variants``: named policy variants served side by side;
* ``own_server``: the server a replay starts for itself;
* ``schedule_model``: a policy's cost and evidence modelled without an engine
  (``benchmarks/schedule_sim.py``);
* ``retrieval``: which embedder recalls the memory holding a needed value
  (``benchmarks/retrieval.py``);
* ``cli``: ``vllm-pamer replay``.
"""
