"""The JSON of the hosts' frames and the event log (protocol/fastjson.py): orjson where it can,
the standard library where orjson refuses, and the same values back either way."""

from __future__ import annotations

import json
import math

import pytest

from nonstop.protocol import fastjson


def test_the_same_values_come_back_as_through_the_standard_library():
    rec = {"t": 1795625337.6245203, "type": "rank_left", "wid": 7, "gen": 3, "ok": True,
           "none": None, "nested": {"a": [1, 2.5, "é"]}, "text": "line\nwith \"quotes\""}
    out = fastjson.dumps(rec)
    assert isinstance(out, bytes)
    assert fastjson.loads(out) == rec == json.loads(out)
    assert fastjson.loads(out.decode()) == rec  # str as well as bytes
    assert fastjson.loads(memoryview(bytearray(out))) == rec


def test_non_string_keys_become_strings_as_with_the_standard_library():
    assert fastjson.loads(fastjson.dumps({1: "a", 2: {3: 4}})) == {"1": "a", "2": {"3": 4}}


def test_64_bit_integers_come_back_exactly_and_wider_ones_are_still_written():
    edges = {"u64": 2 ** 64 - 1, "i64": -2 ** 63, "small": -3}  # (digests are 64-bit)
    assert fastjson.loads(fastjson.dumps(edges)) == edges
    wide = fastjson.dumps({"wide": 2 ** 100 + 7})  # orjson refuses it: the standard library
    assert json.loads(wide) == {"wide": 2 ** 100 + 7}


def test_nan_written_by_the_standard_library_is_still_read():
    text = json.dumps({"loss": float("nan"), "inf": float("inf")})
    got = fastjson.loads(text.encode())
    assert math.isnan(got["loss"]) and got["inf"] == math.inf


def test_default_makes_text_of_what_json_cannot_hold_and_without_it_a_type_error():
    class Odd:
        def __str__(self) -> str:
            return "odd!"

    assert fastjson.loads(fastjson.dumps({"x": Odd()}, default=str)) == {"x": "odd!"}
    with pytest.raises(TypeError):
        fastjson.dumps({"x": Odd()})


def test_text_that_is_not_json_is_a_value_error():
    for bad in (b"{not json", b"", b"\xff\xfe"):
        with pytest.raises(ValueError):
            fastjson.loads(bad)
