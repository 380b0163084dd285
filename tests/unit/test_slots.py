"""The worker's slot table and its reload state machine, with a fake loader: no model, no
sockets. The loader thread's outcome is collected from `post` as the model thread would."""

import dataclasses
import gc
import queue
import threading
import weakref
from pathlib import Path


from gpu_workers.slots import Built, Slots
from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, ModelSpec
from shmserve.protocol import Commit, Reload, ReloadStatus

SPEC = ModelSpec("m", Path("/models/a"), "embedding", "mean", True, 64, 32, "fp32", "r1")
CONFIG = ModelConfig(name="m", source="/models/a")


class FakeModel:
    def __init__(self, name: str, released: list[str]) -> None:
        self.name = name
        weakref.finalize(self, released.append, name)  # when it is really gone

    def __eq__(self, other) -> bool:
        return self.name == other


class Harness:
    def __init__(self, stage_timeout_s: float = 60.0) -> None:
        self.inbox: queue.Queue[Built] = queue.Queue()
        self.released: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.counted: list[tuple[str, str]] = []  # what reconcile did (the worker's metric)
        self.slots = Slots(self.build, gc.collect, self.inbox.put, stage_timeout_s,
                           lambda unit, outcome: self.counted.append((unit, outcome)))
        self.slots.add(CONFIG, SPEC, FakeModel("model-r1", self.released))

    def build(self, config: ModelConfig, active: ModelSpec):
        self.gate.wait(10)
        if "corrupt" in config.source:
            raise ModelSourceError(f"cannot load {config.source}: header too large")
        if "huge" in config.source:
            raise MemoryError("out of memory")
        revision = config.revision or "digest"
        return (dataclasses.replace(active, revision=revision),
                FakeModel(f"model-{revision}", self.released))

    def built(self):
        """What the model thread does when the loader posts its outcome."""
        item = self.inbox.get(timeout=10)
        return self.slots.built(item)


def test_reload_stages_then_commit_switches_and_frees_the_old_slot_when_unpinned():
    h = Harness()
    old = h.slots.active("m")
    assert h.slots.reload(b"fe", Reload(1, "t1", "m", "/models/b", "r2")) == []
    [(peer, done)] = h.built()
    assert (peer, done.seq, done.status, done.revision) == (b"fe", 1, ReloadStatus.OK, "r2")
    assert h.slots.active("m") is old  # staged only: the active slot keeps serving
    assert [(i.revision, i.state, i.standby) for i in h.slots.infos()] == [("r1", "staged", "r2")]
    [(_, done)] = h.slots.commit(b"fe", Commit(2, "t1", "m", True))
    assert (done.status, done.revision, done.message) == (ReloadStatus.OK, "r2", "switched")
    new = h.slots.active("m")
    assert new.spec.revision == "r2" and new.key != old.key and new.source == "/models/b"
    assert [(i.revision, i.state) for i in h.slots.infos()] == [("r2", "ready")]
    h.slots.collect({old.key})  # a queued text is still pinned to the old slot
    assert h.released == [] and old.model == "model-r1"
    h.slots.collect(set())
    assert h.released == ["model-r1"] and old.model is None


def test_a_failed_load_leaves_the_active_slot_and_reports_why():
    h = Harness()
    h.slots.reload(b"fe", Reload(1, "t1", "m", "/models/corrupt", ""))
    [(_, done)] = h.built()
    assert done.status == ReloadStatus.INVALID and "header too large" in done.message
    assert h.slots.active("m").spec.revision == "r1" and h.released == []
    h.slots.reload(b"fe", Reload(2, "t2", "m", "/models/huge", ""))
    [(_, done)] = h.built()
    assert done.status == ReloadStatus.FAILED and "MemoryError" in done.message
    assert [i.state for i in h.slots.infos()] == ["ready"]


def test_one_reload_at_a_time_and_commits_need_their_ticket():
    h = Harness()
    h.gate.clear()  # the loader blocks: the reload stays in "loading"
    h.slots.reload(b"fe", Reload(1, "t1", "m", "", "r2"))
    assert [(i.state, i.standby) for i in h.slots.infos()] == [("loading", "r2")]
    [(_, busy)] = h.slots.reload(b"fe2", Reload(5, "t9", "m", "/x", ""))
    assert busy.status == ReloadStatus.BUSY
    [(_, unknown)] = h.slots.reload(b"fe", Reload(6, "t9", "nope", "", ""))
    assert unknown.status == ReloadStatus.INVALID
    h.gate.set()
    h.built()
    [(_, wrong)] = h.slots.commit(b"fe2", Commit(7, "t9", "m", False))
    assert wrong.status == ReloadStatus.INVALID  # another caller's drop leaves it staged
    assert h.slots.infos()[0].state == "staged"
    [(_, dropped)] = h.slots.commit(b"fe", Commit(8, "t1", "m", False))
    assert dropped.message == "dropped" and h.released == ["model-r2"]
    assert h.slots.active("m").spec.revision == "r1"
    # Empty source: the active slot's source is read again.
    h.slots.reload(b"fe", Reload(9, "t3", "m", "", ""))
    h.built()
    h.slots.commit(b"fe", Commit(10, "t3", "m", True))
    assert h.slots.active("m").source == "/models/a"


def test_a_drop_during_loading_cancels_and_frees_the_late_slot():
    h = Harness()
    h.gate.clear()
    h.slots.reload(b"fe", Reload(1, "t1", "m", "", "r2"))
    [(_, done)] = h.slots.commit(b"fe", Commit(2, "t1", "m", False))
    assert done.message == "cancelled" and h.slots.infos()[0].state == "ready"
    h.gate.set()
    assert h.built() == [] and h.released == ["model-r2"]


def test_a_staged_slot_never_committed_expires():
    h = Harness(stage_timeout_s=0.0)
    h.slots.reload(b"fe", Reload(1, "t1", "m", "", "r2"))
    h.built()
    h.slots.expire(float("inf"))
    assert h.released == ["model-r2"] and h.slots.infos()[0].state == "ready"
    [(_, late)] = h.slots.commit(b"fe", Commit(2, "t1", "m", True))
    assert late.status == ReloadStatus.INVALID


def test_revisions_never_mix_in_the_batcher():
    """Texts pinned to two slots of one model are never batched together."""
    from gpu_workers.batcher import Limits, form_batch

    @dataclasses.dataclass
    class Text:
        model: str
        length: int
        priority: int = 0
        arrived: float = 0.0

    queue_ = [Text("m#0", 5), Text("m#1", 5), Text("m#0", 6), Text("m#1", 5)]
    batch, rest = form_batch(queue_, Limits(32, 8192, 0.0, 10.0))
    assert {t.model for t in batch.texts} == {"m#0"} and len(rest) == 2


def test_every_outcome_of_a_reload_is_logged_by_the_worker(caplog):
    # A worker's log tells how each reload ended, not only that it started.
    caplog.set_level("INFO", logger="shmserve.worker")
    h = Harness()
    h.slots.reload(b"fe", Reload(1, "t1", "m", "", "r2"))
    h.built()
    h.slots.commit(b"fe", Commit(2, "t1", "m", True))
    h.slots.reload(b"fe", Reload(3, "t2", "m", "", "r3"))
    h.built()
    h.slots.commit(b"fe", Commit(4, "t2", "m", False))
    h.gate.clear()
    h.slots.reload(b"fe", Reload(5, "t3", "m", "", "r4"))
    h.slots.commit(b"fe", Commit(6, "t3", "m", False))
    h.gate.set()
    h.built()
    events = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker.")]
    assert events == ["worker.reload_started", "worker.reload_staged", "worker.switched",
                      "worker.reload_started", "worker.reload_staged", "worker.reload_dropped",
                      "worker.reload_started", "worker.reload_cancelled"], events


# The run state (state.json's sources) is what every worker converges to: an outside check
# found a model served from two revisions until a restart, in two ways (below).

def test_a_worker_that_loaded_before_the_state_changed_loads_what_it_records():
    """A worker restarted during a reload loads the sources from before it; the reload then
    records the new one and the commit finds nothing staged there. It loads it itself, and
    switches once loaded (nobody to commit it)."""
    h = Harness()
    old = h.slots.active("m")
    wanted = {"m": {"source": "/models/b", "revision": "r2"}}
    assert h.slots.reconcile({}) == [] and h.inbox.empty()  # nothing recorded: the config's
    assert h.slots.reconcile({"m": {"source": "/models/a", "revision": ""}}) == []
    assert h.inbox.empty()  # what it serves (the digest, whatever it is, when none is given)
    h.gate.clear()
    assert h.slots.reconcile(wanted) == []
    assert [(i.state, i.standby) for i in h.slots.infos()] == [("loading", "r2")]
    assert h.slots.reconcile(wanted) == []  # under way: not started twice
    [(_, busy)] = h.slots.reload(b"fe", Reload(1, "t1", "m", "/models/c", ""))
    assert busy.status == ReloadStatus.BUSY and "the run state's, loading revision r2" in \
        busy.message
    h.gate.set()
    assert h.built() == []  # no reply: nobody asked
    new = h.slots.active("m")
    assert (new.source, new.spec.revision, new.key != old.key) == ("/models/b", "r2", True)
    assert [(i.revision, i.state) for i in h.slots.infos()] == [("r2", "ready")]
    h.slots.collect(set())
    assert h.released == ["model-r1"]
    assert h.slots.reconcile(wanted) == [] and h.inbox.empty()  # converged
    assert h.counted == [("m", "loaded")]


def test_a_recorded_source_that_fails_here_is_not_tried_in_a_loop(caplog):
    caplog.set_level("INFO", logger="shmserve.worker")
    h = Harness()
    broken = {"m": {"source": "/models/corrupt", "revision": ""}}
    h.slots.reconcile(broken)
    assert h.built() == [] and h.slots.active("m").spec.revision == "r1"
    failed = [r for r in caplog.records if r.getMessage() == "worker.reconcile_failed"]
    assert len(failed) == 1 and "header too large" in failed[0].fields["error"]
    assert [i.state for i in h.slots.infos()] == ["diverged"]  # /admin/models says so
    h.slots.reconcile(broken)
    assert h.inbox.empty()  # not again, until the state records another source
    h.slots.reconcile({"m": {"source": "/models/b", "revision": ""}})
    h.built()
    assert h.slots.active("m").source == "/models/b"
    assert h.counted == [("m", "failed"), ("m", "loaded")]
    assert [i.state for i in h.slots.infos()] == ["ready"]


def test_a_standby_the_state_records_switches_and_its_late_commit_is_answered():
    """The reload's frontend recorded the state and died before committing: the workers held
    the new weights staged (and served the old) until a restart loaded the recorded ones on
    one of them. The standby the state records switches; a commit that does come is OK."""
    h = Harness()
    h.slots.reload(b"fe", Reload(1, "t1", "m", "/models/b", "r2"))
    h.built()
    h.slots.reconcile({"m": {"source": "/models/a", "revision": "r1"}})
    assert h.slots.infos()[0].state == "staged"  # not what the state records: left staged
    h.slots.reconcile({"m": {"source": "/models/b", "revision": "r2"}})
    assert [(i.revision, i.state) for i in h.slots.infos()] == [("r2", "ready")]
    assert h.inbox.empty() and h.counted == [("m", "standby")]  # switched, nothing loaded
    [(peer, late)] = h.slots.commit(b"fe", Commit(2, "t1", "m", True))
    assert (peer, late.status, late.revision, late.message) == (
        b"fe", ReloadStatus.OK, "r2", "switched")
    [(_, other)] = h.slots.commit(b"fe", Commit(3, "t9", "m", True))
    assert other.status == ReloadStatus.INVALID


def test_a_gone_frontends_reloads_are_cancelled_and_a_busy_refusal_says_what_holds_it():
    h = Harness(stage_timeout_s=100.0)
    h.slots.reload(b"fe", Reload(1, "t1", "m", "/models/b", "r2"))
    h.built()
    [(_, busy)] = h.slots.reload(b"fe2", Reload(2, "t2", "m", "/models/c", ""))
    assert busy.status == ReloadStatus.BUSY
    assert "(revision r2 staged 0 s ago, waiting for its commit; dropped at 100 s " \
        "(admin.reload_timeout_s) if none comes)" in busy.message, busy.message
    h.slots.orphaned(b"other")  # another frontend's going: not this reload's
    assert h.slots.infos()[0].state == "staged"
    h.slots.orphaned(b"fe")
    assert h.slots.infos()[0].state == "ready" and h.released == ["model-r2"]
    h.gate.clear()
    h.slots.reload(b"fe2", Reload(3, "t3", "m", "/models/c", "r3"))
    h.slots.orphaned(b"fe2")
    assert h.slots.infos()[0].state == "ready"
    h.gate.set()
    assert h.built() == [] and "model-r3" in h.released
    assert h.slots.active("m").spec.revision == "r1"
