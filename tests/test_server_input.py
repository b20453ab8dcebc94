"""The chat route's checks of the plugin's own request fields."""

from __future__ import annotations

import pytest

from vllm_pamer.server.input import InputError, context_budget_of


@pytest.mark.parametrize(
    "header, field, want",
    [(None, None, None), ("4096", None, 4096), (None, 3000, 3000), ("2048", 9999, 2048), (None, "1500", 1500)],
)
def test_the_context_budget_comes_from_the_header_or_the_body(header, field, want):
    assert context_budget_of(header, field) == want


@pytest.mark.parametrize(
    "header, field", [("0", None), ("-5", None), ("lots", None), (None, 2.5), (None, True), (None, [4096]), ("", None)]
)
def test_a_bad_context_budget_is_a_clear_400(header, field):
    with pytest.raises(InputError, match="positive number of tokens") as error:
        context_budget_of(header, field)
    assert error.value.status == 400
