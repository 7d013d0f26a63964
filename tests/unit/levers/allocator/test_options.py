"""Allocator option strings: parse, render, and which variable torch reads (CPU only)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_bridge_ext.levers.allocator import ALLOC_VAR, CUDA_VAR, setup_allocator
from megatron_bridge_ext.levers.allocator.options import (
    BOOLEAN_KEYS,
    AllocConf,
    AllocatorConfigError,
    Option,
    effective,
    precedence_for,
)
from tests.support.allocator import ES, NEW

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------------------------
# Parse / render
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "expandable_segments:True",
    "max_split_size_mb:512,expandable_segments:False,garbage_collection_threshold:0.8",
    "roundup_power2_divisions:[256:1,512:2,>:8],backend:native",
    "roundup_power2_divisions:4",
    "my_future_key:42,expandable_segments:True",
    "expandable_segments:False,expandable_segments:True",
])
def test_canonical_strings_round_trip(text):
    conf = AllocConf.parse(text, CUDA_VAR)
    assert conf.render() == text
    assert AllocConf.parse(conf.render()) == conf


def test_list_value_is_kept_item_by_item_and_order_is_preserved():
    conf = AllocConf.parse("a_key:1,roundup_power2_divisions:[256:1,512:2,>:8],z_key:2")
    assert conf.keys() == ["a_key", "roundup_power2_divisions", "z_key"]
    assert conf.get("roundup_power2_divisions") == ("256:1", "512:2", ">:8")


def test_whitespace_and_one_trailing_comma_are_accepted_like_torch():
    conf = AllocConf.parse(" roundup_power2_divisions : [ 256:1 , >:8 ] , expandable_segments : True , ")
    assert conf.render() == "roundup_power2_divisions:[256:1,>:8],expandable_segments:True"


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_value_is_no_options(text):
    assert AllocConf.parse(text).options == ()


def test_duplicated_keys_are_kept_and_the_last_wins():
    conf = AllocConf.parse("expandable_segments:True,max_split_size_mb:256,expandable_segments:False")
    assert conf.flag("expandable_segments") is False
    assert conf.duplicates() == ["expandable_segments"]
    assert conf.render().count("expandable_segments") == 2


def test_with_option_replaces_the_last_occurrence_in_place_or_appends():
    conf = AllocConf.parse("a_key:1,expandable_segments:False,b_key:2")
    assert conf.with_option("expandable_segments", "True").render() == "a_key:1,expandable_segments:True,b_key:2"
    assert AllocConf.parse("a_key:1").with_option("expandable_segments", "True").render() == "a_key:1," + ES


@pytest.mark.parametrize("text, token", [
    ("expandable_segments", "expandable_segments"),
    (":True", ":True"),
    ("expandable_segments:", "expandable_segments:"),
    ("max_split_size_mb:512,,expandable_segments:True", ",,"),
    (",expandable_segments:True", ","),
    ("roundup_power2_divisions:[256:1", "roundup_power2_divisions:[256:1"),
    ("max_split_size_mb:512]", "max_split_size_mb:512]"),
    ("roundup_power2_divisions:[256:[1]]", "roundup_power2_divisions:[256:["),
    ("roundup_power2_divisions:[256:1,,>:8]", "[256:1,,>:8]"),
    ("roundup_power2_divisions:[]", "[]"),
    ("roundup_power2_divisions:[256:1]x", "[256:1]x"),
    ("max_split_size_mb:512:1", "512:1"),
    ("expandable segments:True", "expandable segments"),
    ("expandable_segments:true", "expandable_segments:true"),
    ("expandable_segments:1", "expandable_segments:1"),
    ("9key:1", "9key"),
])
def test_malformed_strings_name_the_variable_and_the_token(text, token):
    with pytest.raises(AllocatorConfigError) as info:
        AllocConf.parse(text, CUDA_VAR)
    message = str(info.value)
    assert message.startswith(f"{CUDA_VAR}={text!r}:")
    assert f"at {token!r}" in message
    assert "Fix:" in message


def test_setup_refuses_malformed_user_value_without_touching_the_environment():
    env = {ALLOC_VAR: "max_split_size_mb:512,,"}
    with pytest.raises(AllocatorConfigError, match=ALLOC_VAR):
        setup_allocator(env, torch_version=NEW)
    assert env == {ALLOC_VAR: "max_split_size_mb:512,,"}


_keys = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_tokens = st.from_regex(r"[A-Za-z0-9_.>]{1,8}", fullmatch=True)
_values = st.one_of(_tokens, st.lists(st.builds(lambda a, b: f"{a}:{b}", _tokens, _tokens), min_size=1,
                                      max_size=4).map(tuple))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.builds(Option, _keys, _values), max_size=6))
def test_render_then_parse_is_the_identity(options):
    # torch takes only True/False for its boolean keys; the parser enforces that, so skip other values there
    conf = AllocConf(tuple(o for o in options if o.key not in BOOLEAN_KEYS or o.value in ("True", "False")))
    assert AllocConf.parse(conf.render()) == conf


@pytest.mark.parametrize("text, key", [("max_split_size_mb:abc", "max_split_size_mb"),
                                       ("garbage_collection_threshold:high", "garbage_collection_threshold"),
                                       ("max_non_split_rounding_mb:-3", "max_non_split_rounding_mb")])
def test_a_number_option_must_be_a_number(text, key):
    with pytest.raises(AllocatorConfigError, match=f"{key}.*torch reads a number here.*Fix: write {key}:<number>"):
        AllocConf.parse(text, ALLOC_VAR)
    assert AllocConf.parse(f"{key}:0.5" if "threshold" in key else f"{key}:512", ALLOC_VAR).get(key)


def test_effective_follows_the_installed_torch_order():
    env = {CUDA_VAR: "max_split_size_mb:64", ALLOC_VAR: ES}
    assert effective(env, (2, 14))[0] == CUDA_VAR
    assert effective(env, (2, 10))[0] == ALLOC_VAR
    assert precedence_for((2, 14)).default_target == ALLOC_VAR
