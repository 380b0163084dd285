"""KServe bodies: JSON and binary tensor data, both ways, with awkward shapes and bad framing."""

import json
import struct

import numpy as np
import pytest

from frontend import tensors
from frontend.errors import ApiError
from frontend.tensors import Tensor


def binary_request(header: dict, *chunks: bytes) -> tuple[bytes, str]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), str(len(head))


def bytes_elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def test_json_bytes_input_flat_or_nested():
    header, tail = tensors.split_body(json.dumps({"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": [["a"], ["ü"]]}]}).encode(),
        None)
    (t,) = tensors.read_inputs(header, tail)
    assert t.name == "text" and t.shape == (2, 1) and t.data == [b"a", "ü".encode()]


def test_binary_inputs_in_header_order_with_an_empty_string():
    elements = bytes_elements(b"hello", b"", "ünï".encode())
    floats = np.arange(6, dtype="<f4").reshape(2, 3)
    raw, length = binary_request({"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [3],
         "parameters": {"binary_data_size": len(elements)}},
        {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": floats.ravel().tolist()},
        {"name": "y", "datatype": "FP32", "shape": [2, 3],
         "parameters": {"binary_data_size": floats.nbytes}}]}, elements, floats.tobytes())
    text, x, y = tensors.read_inputs(*tensors.split_body(raw, length))
    assert text.data == [b"hello", b"", "ünï".encode()]
    np.testing.assert_array_equal(x.data, floats.ravel())
    np.testing.assert_array_equal(y.data, floats.ravel())


def test_whole_floats_are_the_integers_the_document_declares():
    """shape [1.0] and binary_data_size 9.0 were refused (the latter as "does not fit the 9
    bytes left"), where the OpenAPI document's integer takes them (an outside check)."""
    elements = bytes_elements(b"hello")
    raw, length = binary_request({"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1.0],
         "parameters": {"binary_data_size": float(len(elements))}}],
        "parameters": {"priority": 1.0, "timeout": 1.5e6}}, elements)
    header, tail = tensors.split_body(raw, length)
    (text,) = tensors.read_inputs(header, tail)
    assert text.shape == (1,) and type(text.shape[0]) is int and text.data == [b"hello"]
    assert tensors.scheduling(header) == (10, 1.5)
    with pytest.raises(ApiError, match="'shape' must be a list"):
        tensors.read_inputs({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1.5],
                                         "data": ["a"]}]}, b"")


def test_a_binary_data_size_not_a_count_says_so():
    # "10" was "binary_data_size '10' does not fit the 10 bytes left" (an outside check)
    for size, shown in (("10", '"10"'), (-1, "-1"), (1.5, "1.5"), (True, "true")):
        head = json.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1],
                                       "parameters": {"binary_data_size": size}}]}).encode()
        with pytest.raises(ApiError) as info:
            tensors.read_inputs(*tensors.split_body(head + bytes_elements(b"abcdef"),
                                                    str(len(head))))
        assert info.value.status == 400
        assert info.value.message.endswith(f"an integer from 0), not {shown}"), info.value.message


@pytest.mark.parametrize("header,tail,length,status", [
    ({"inputs": []}, b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
     b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": [1]}]}, b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "STRING", "shape": [1], "data": ["a"]}]},
     b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [-1], "data": ["a"]}]},
     b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1]}]}, b"", None, 422),
    # binary_data_size larger than what follows the header
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1],
                  "parameters": {"binary_data_size": 99}}]}, bytes_elements(b"a"), "len", 400),
    # bytes left over
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
     b"junk", "len", 400),
    # a BYTES element's length prefix runs past its tensor
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1],
                  "parameters": {"binary_data_size": 6}}]}, struct.pack("<I", 9) + b"ab",
     "len", 422),
    ({"inputs": [{"name": "t", "datatype": "FP32", "shape": [2],
                  "parameters": {"binary_data_size": 4}}]}, b"\0\0\0\0", "len", 422),
    ({"inputs": [{"name": "t", "datatype": "INT8", "shape": [1], "data": [300]}]},
     b"", None, 422),
    ({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": ["a"],
                  "parameters": {"shared_memory_region": "r"}}]}, b"", None, 422),
])
def test_bad_inputs(header, tail, length, status):
    head = json.dumps(header).encode()
    with pytest.raises(ApiError) as info:
        tensors.read_inputs(*tensors.split_body(head + tail,
                                                str(len(head)) if length else None))
    assert info.value.status == status, info.value.message


@pytest.mark.parametrize("shape", [[2**63 - 1] * 20_000, [2**63 - 1] * 240, [1] * 9,
                                   [2**31, 1], [True]])
@pytest.mark.parametrize("binary", [False, True])
def test_a_shape_past_any_models_is_refused_as_declared_with_a_short_message(shape, binary):
    """Refused as declared, before any product of the dimensions: a long list of huge ones
    took seconds of big-integer products (140,000 over 30 s), and one past 4,300 digits a 500
    (its size could not be formatted into the error)."""
    entry = {"name": "t", "datatype": "BYTES", "shape": shape}
    if binary:
        entry["parameters"] = {"binary_data_size": 9}
        raw, length = binary_request({"inputs": [entry]}, bytes_elements(b"hello"))
    else:
        entry["data"] = ["a"]
        raw, length = json.dumps({"inputs": [entry]}).encode(), None
    with pytest.raises(ApiError) as info:
        tensors.read_inputs(*tensors.split_body(raw, length))
    assert info.value.status == 422 and len(info.value.message) < 200, info.value.message
    assert "at most 8 integers from 0 to 2147483647" in info.value.message


@pytest.mark.parametrize("raw,length", [
    (b"{", None), (b"[1]", None), (b'{"inputs": []}', "0"), (b'{"inputs": []}', "999"),
    (b'{"inputs": []}', "ten"), (b'{"a": NaN}', None), (b"\xff", None),
])
def test_bad_framing(raw, length):
    with pytest.raises(ApiError) as info:
        tensors.split_body(raw, length)
    assert info.value.status in (400, 422)


def test_requested_outputs():
    names = ["embedding", "other"]
    assert tensors.requested_outputs({}, names) == [("embedding", False), ("other", False)]
    assert tensors.requested_outputs({"outputs": []}, names) == [("embedding", False),
                                                               ("other", False)]
    assert tensors.requested_outputs({"parameters": {"binary_data_output": True}}, names) == [
        ("embedding", True), ("other", True)]
    assert tensors.requested_outputs({"parameters": {"binary_data_output": True}, "outputs": [
        {"name": "other", "parameters": {"binary_data": False}}, {"name": "embedding"}]},
        names) == [("other", False), ("embedding", True)]
    for bad in ({"outputs": [{"name": "nope"}]}, {"outputs": "embedding"},
                {"outputs": [{"name": "other", "parameters": {"classification": 2}}]},
                {"outputs": [{"name": "other", "parameters": {"shared_memory_region": "r",
                                                              "shared_memory_byte_size": 8}}]},
                {"parameters": {"binary_data_output": "yes"}}):
        with pytest.raises(ApiError):
            tensors.requested_outputs(bad, names)


def test_tritons_priority_and_timeout_parameters():
    # They were taken and ignored: a client's priority and timeout did nothing.
    assert tensors.scheduling({}) == (None, None)
    assert tensors.scheduling({"parameters": {"priority": 0, "timeout": 0}}) == (None, None)
    levels = [tensors.scheduling({"parameters": {"priority": p}})[0] for p in (1, 2, 11, 21, 99)]
    assert levels == [10, 9, 0, -10, -10]  # 1 is the highest, as Triton's
    assert tensors.scheduling({"parameters": {"timeout": 1_500_000}}) == (None, 1.5)
    for bad in ({"priority": -1}, {"priority": "high"}, {"priority": True}, {"priority": 1.5},
                {"timeout": -5}, {"timeout": "1s"}, {"timeout": 3600 * 10**6 + 1}):
        with pytest.raises(ApiError) as info:
            tensors.scheduling({"parameters": bad})
        assert info.value.status == 422 and info.value.param == "parameters", bad


def test_response_json_then_binary_in_order():
    emb = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    labels = Tensor("labels", "BYTES", (2,), [b"x", "ÿ".encode()])
    head = {"model_name": "m", "model_version": "1", "id": "r1"}
    body, length = tensors.encode_response(head, [(Tensor("e", "FP32", (2, 4), emb), False)])
    assert length is None
    out = json.loads(body)
    assert out["id"] == "r1" and out["outputs"][0]["shape"] == [2, 4]
    np.testing.assert_array_equal(np.array(out["outputs"][0]["data"], np.float32), emb.ravel())
    # float32 as its shortest decimal (0.33333334), not its float64 widening (0.3333333432674408)
    assert b"0.33333334," in body and b"0.3333333432" not in body

    body, length = tensors.encode_response(head, [(Tensor("e", "FP32", (2, 4), emb), True),
                                                  (labels, True)])
    header = json.loads(body[:length])
    e_size = header["outputs"][0]["parameters"]["binary_data_size"]
    assert e_size == emb.nbytes and "data" not in header["outputs"][0]
    np.testing.assert_array_equal(np.frombuffer(body[length:length + e_size], "<f4"),
                                  emb.ravel())
    assert body[length + e_size:] == bytes_elements(b"x", "ÿ".encode())


def test_empty_tensor_round_trips():
    raw, length = binary_request({"inputs": [{"name": "t", "datatype": "FP32", "shape": [0, 3],
                                              "parameters": {"binary_data_size": 0}}]})
    (t,) = tensors.read_inputs(*tensors.split_body(raw, length))
    assert t.size == 0 and t.data.shape == (0,)


def test_an_inference_header_of_more_arrays_than_any_request_needs_is_refused_unparsed():
    """8 MB of `[]` (8 KB of gzip) in KServe's JSON took a frontend's event loop ~1.5 s and
    ~210 MB each, where every other route refuses such a body at once: twenty at once got both
    frontends killed as hung (an outside check). The header is counted as any JSON body is."""
    from frontend.codec import MAX_CONTAINERS

    data = ",".join(["[]"] * (MAX_CONTAINERS + 1))
    raw = ('{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [%s]}]}'
           % data).encode()
    for length in (None, str(len(raw))):
        with pytest.raises(ApiError) as info:
            tensors.split_body(raw, length)
        assert info.value.status == 400 and info.value.message == (
            f"the inference request header holds more than {MAX_CONTAINERS:,} arrays and "
            "objects; no request needs as many"), info.value.message
