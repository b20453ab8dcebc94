"""Training data for the memory heads.

``vllm_pamer.training.annotate``: decision-point labels (recall / compression)
from recorded trajectories, behind a pluggable ``Annotator`` registry.
"""
