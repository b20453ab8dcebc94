"""Training the memory heads, in three steps (each a ``vllm-pamer`` command):

``annotate`` - decision-point labels (recall / compression) from recorded
trajectories, behind a pluggable ``Annotator`` registry;
``extract`` - final-norm states of each decision point on the vLLM engine,
through the serving capture path (full context and Recent2);
``train`` - MLP/linear heads with class-weighted BCE and decision
distillation over grouped seeds, controls, a report, and the heads file the
server loads (``metrics`` holds AUROC/AUPRC/F1 and threshold selection).
"""
