"""gpud.base.bounded_json: JSON from a child or a peer, nesting bounded, one clear ValueError."""
import pytest

from gpud.base import bounded_json


@pytest.mark.parametrize("depth", [65, 2_000, 40_000])
def test_a_document_nested_deeper_than_the_bound_is_refused_naming_what_was_read(depth):
    with pytest.raises(bounded_json.JsonTooDeep, match="dcgmi's answer nests lists or objects more than 64 deep"):
        bounded_json.loads("[" * depth + "]" * depth, what="dcgmi's answer")


def test_a_document_at_the_bound_is_read():
    assert bounded_json.loads(b'{"a":' * 63 + b"[1]" + b"}" * 63, what="x") is not None


def test_many_brackets_side_by_side_are_not_depth():
    assert bounded_json.loads("[" + ",".join(["[]"] * 10_000) + "]", what="x") == [[]] * 10_000


@pytest.mark.parametrize("raw, why", [("nope", "is not valid JSON"), (b"\xff\xfe", "is not valid JSON|is not UTF-8"),
                                      ("", "is not valid JSON")])
def test_what_is_not_json_is_one_value_error_naming_what_was_read(raw, why):
    with pytest.raises(ValueError, match=f"the kubelet's answer ({why})"):
        bounded_json.loads(raw, what="the kubelet's answer")
