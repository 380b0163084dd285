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


def test_each_model_names_the_workers_that_load_it_and_their_state_of_it():
    """GET /info names a model's workers (models.devices) and what each says of it; it had no
    placement at all (GET /admin/models alone had it, behind the admin token)."""
    from frontend.info import _hosts
    from frontend.links import WorkerLink
    from shmserve.config import from_tree
    from shmserve.protocol import ModelInfo, Unloaded

    cfg = from_tree({
        "workers": {"devices": "cpu", "cpu_workers": 3},
        "models": [{"name": "a", "source": "/m/a", "devices": [0, 2]},
                   {"name": "b", "source": "/m/b"}]})

    def link(index, alive=True, ready=True, states=(), unloaded=()):
        beat = Heartbeat(PROTOCOL_VERSION, index, 100 + index, ready, "cpu",
                         tuple(ModelInfo(name, "embedding", 8, 32, "fp32", "r1", state, "")
                               for name, state in states), 0, 10, 0.0, 0.0,
                         unloaded=tuple(Unloaded(name, "OSError: no file", 2, 5.0)
                                        for name in unloaded))
        return WorkerLink(index, f"ipc://w{index}", None, beat=beat, alive=alive)

    pool = SimpleNamespace(links=[
        link(0, states=[("a", "ready"), ("b", "loading")]),
        link(1, states=[("b", "ready")]),
        link(2, states=[("b", "ready")], unloaded=["a"])])
    assert _hosts(cfg, "a", pool) == [{"worker": 0, "state": "ready"},
                                      {"worker": 2, "state": "failed"}]
    assert _hosts(cfg, "b", pool) == [{"worker": 0, "state": "loading"},
                                      {"worker": 1, "state": "ready"},
                                      {"worker": 2, "state": "ready"}]
    pool.links[2].alive = False
    pool.links[0] = link(0, ready=False, states=[("a", "ready")])
    assert _hosts(cfg, "a", pool) == [{"worker": 0, "state": "loading"},
                                      {"worker": 2, "state": "down"}]
