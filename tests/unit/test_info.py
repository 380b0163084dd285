from types import SimpleNamespace

from frontend.info import _device
from shmserve.protocol import PROTOCOL_VERSION, Heartbeat


def pool_with(device_label: str | None, ready: bool = True):
    beat = None if device_label is None else Heartbeat(
        PROTOCOL_VERSION, 0, 123, ready, device_label, (), 0, 10, 0.0, 0.0)
    return SimpleNamespace(links=[SimpleNamespace(beat=beat, ready=beat is not None and ready)])


def test_a_gpu_configured_worker_on_a_machine_without_one_reports_the_cpu():
    assert _device(0, "0", pool_with("cpu")) == {
        "worker": 0, "device": "cpu", "name": "cpu", "configured": "cuda:0", "ready": True}


def test_a_gpu_worker_reports_the_gpu_it_was_given_and_its_name():
    assert _device(0, "3", pool_with("cuda:NVIDIA H200")) == {
        "worker": 0, "device": "cuda:3", "name": "cuda:NVIDIA H200", "configured": "cuda:3",
        "ready": True}


def test_the_device_is_unknown_until_the_worker_reports_it():
    for label in (None, "loading"):
        info = _device(0, "0", pool_with(label, ready=False))
        assert info["device"] is None and info["name"] is None and info["ready"] is False
        assert info["configured"] == "cuda:0"


def test_tei_model_type_and_scoring_models_say_what_they_are():
    from frontend.info import _tei_model_type

    embedding = {"task": "embedding", "pooling": "cls"}
    assert _tei_model_type(embedding) == {"embedding": {"pooling": "cls"}}
    classifier = {"task": "classification", "labels": ["neg", "pos"]}
    assert _tei_model_type(classifier) == {"classifier": {
        "id2label": {"0": "neg", "1": "pos"}, "label2id": {"neg": 0, "pos": 1}}}
    assert _tei_model_type({"task": "rerank", "pooling": None}) == {"reranker": {
        "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
