"""Training the memory heads, in three steps (each a ``vllm-pamer`` command,
parsed in ``cli``):

``annotate`` - decision contexts (P / O / R) and decision-point labels
(recall / compression) from recorded trajectories, behind a pluggable
``Annotator`` registry (salient values: ``vllm_pamer.salient``);
``extract`` - final-norm states of each decision point on the vLLM engine
(``vllm_pamer.offline_engine``), through the serving capture path (full
context and Recent2);
``data`` - the one reader and writer of the extracted-states format (shards
and manifest), and the labels and trajectory files;
``experiment`` - the per-seed protocol of ``vllm-pamer train`` over
``splits`` (task-grouped), ``probes`` (MLP/linear heads, class-weighted BCE,
decision distillation, export into the heads file) and ``controls`` (the
observable baselines); ``metrics`` holds AUROC/AUPRC/F1 and threshold
selection; ``report`` writes the result up and ``layerwise`` is the depth
diagnostic.
"""
