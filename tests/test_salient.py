"""Salient values (``vllm_pamer/salient.py``): identifiers, paths, dates and
numbers found, plain words and vocabulary not; an action's values; a value
that occurs only whole."""

from __future__ import annotations

import pytest

from tests.support.messages import call, say
from vllm_pamer.salient import action_values, message_text, occurs, salient_values


@pytest.mark.parametrize(
    "text, expected",
    [
        ("My reservation ID is YAX4DR, and the user ID is chen_lee_6825.", {"YAX4DR", "chen_lee_6825"}),
        ("pay with credit_card_4421486 for HAT136", {"credit_card_4421486", "HAT136"}),
        ("fly on 2024-05-20 for $122.50", {"2024-05-20", "122.50"}),
        ("write to mia.li3668@example.com", {"mia.li3668@example.com"}),
        (
            "cat /testbed/django/contrib/admin/views/autocomplete.py",
            {"/testbed/django/contrib/admin/views/autocomplete.py", "views/autocomplete.py"},
        ),
        ("python a/b.py and ./manage.py", {"a/b.py", "manage.py"}),
        ("call self.serialize_result(obj)", {"self.serialize_result", "serialize_result"}),
        ("class AutocompleteJsonView(BaseListView):", {"AutocompleteJsonView", "BaseListView"}),
        ("see lines 120-140 of INSTALLED_APPS", {"120", "140", "INSTALLED_APPS"}),
        ('print("\\nTesting")', set()),  # a literal backslash-n separates words: no "nTesting"
    ],
)
def test_salient_values_finds_identifiers_paths_dates_numbers(text, expected):
    assert salient_values(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "economy business django contrib admin",  # plain words
        "and/or yes/no",  # not paths
        "at 19:00 with 5 bags, e.g. two",  # short numbers, times, e.g.
        "__init__ _meta self",  # dunder and short names
        "raise ValueError or TypeError",  # Python builtins
        "cd /testbed > /dev/null, trip one_way basic_economy",  # stoplist
    ],
)
def test_salient_values_ignores_plain_words_and_vocabulary(text):
    assert salient_values(text) == set()


def test_date_is_one_value_not_a_number():
    assert salient_values("2024-05-20") == {"2024-05-20"}


def test_action_values_use_argument_values_not_keys_or_tool_name():
    action = call(
        "c1", "book_reservation", user_id="mia_li_3668", first_name="Noah", cabin="economy", amount=250, insurance=True
    )
    assert action_values(action) == {"mia_li_3668", "Noah", "250"}


def test_action_values_include_the_text():
    assert action_values(say("Flight HAT235 leaves at 19:00.")) == {"HAT235"}


@pytest.mark.parametrize(
    "value, text, expected",
    [
        ("HAT122", "flight HAT122.", True),
        ("122", "flight HAT122", False),
        ("122", "costs 122.50", False),
        ("122", "costs $122.", True),
        ("b/c.py", "/a/b/c.py", True),
        ("serialize_result", "self.serialize_result(obj)", True),
        ("AutocompleteJsonView", "AutocompleteJsonView.as_view()", True),
        ("2024-05", "2024-05-20", False),
    ],
)
def test_occurs_needs_a_whole_value(value, text, expected):
    assert occurs(value, text) is expected


def test_message_text_decodes_arguments():
    message = call("c1", "bash", command="printf 'a\nb'")
    assert message_text(message) == "printf 'a\nb'"
