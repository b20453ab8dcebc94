# Moved to tests/support/tiny_models.py (benchmarks build these models too). This
# name stays only for tests/engine/test_capture_engine.py, which the offline-capture
# work (issue 30, item 4) rewrites: delete this file once it imports tests.support.
from tests.support.tiny_models import ARCHITECTURES, build_tiny_model, hf_last_token_states

__all__ = ["ARCHITECTURES", "build_tiny_model", "hf_last_token_states"]
