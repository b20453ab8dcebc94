"""PaMER and PaMER+ (the PaMER paper), in one package:

* ``policy.py``: the ``pamer`` policy, which hands each request to its schedule;
* ``config.py``: the options, one config type per schedule;
* ``budget_schedule.py``: the budget schedule (the default), compactions that
  keep vLLM's prefix cache; ``budget.py``: its arithmetic, pure; ``shown.py``:
  the memories its requests show between compactions;
* ``paper_schedule.py``: the paper's Algorithm 1;
* ``memory.py``: writing a memory (summary, embedding), the recall query, the
  memory text shown; ``record.py``: the verbatim record of archived steps;
* ``plus.py``: PaMER+ (step-level evidence), ``selection.py``: its selection check;
* ``schedule_baselines.py``: ``truncate``, ``record_only``,
  ``observation_masking`` and ``excerpt_masking``, the budget schedule with
  less in place of a memory.

Each schedule splits its decision (``decide`` / ``should_compress``) from its
actions (``compact`` and ``send`` / ``compress`` and ``recall``).
"""

from vllm_pamer.core.policies.pamer.config import BudgetConfig, PamerConfig, PaperConfig
from vllm_pamer.core.policies.pamer.plus import PamerPlus, PamerPlusConfig
from vllm_pamer.core.policies.pamer.policy import Pamer
from vllm_pamer.core.policies.pamer.schedule_baselines import ObservationMasking, RecordOnly, Truncate

__all__ = [
    "BudgetConfig",
    "ObservationMasking",
    "Pamer",
    "PamerConfig",
    "PamerPlus",
    "PamerPlusConfig",
    "PaperConfig",
    "RecordOnly",
    "Truncate",
]
