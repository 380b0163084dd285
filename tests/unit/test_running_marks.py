"""The mark a worker writes into each text's first output row as its pass begins, which the
frontend reads once the worker is gone (frontend.dispatch), and the pass of its own a request
sent alone runs in, and a pass's rows written into its requests (gpu_workers.requests)."""

from types import SimpleNamespace

import numpy as np

from frontend.dispatch import _clear_marks, _marked
from gpu_workers.batcher import Limits, form_pass
from gpu_workers.requests import QueuedText, Request, mark_running, write_rows
from shmserve.protocol import RUNNING_MARK, Error, ErrorCode, Submit

SLOT = SimpleNamespace(key="tiny")


def request(lengths: list[int], per_token: bool = False, alone: bool = False,
            stale: bool = False) -> Request:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = int(offsets[-1]) if per_token else len(lengths)
    # arena bytes an earlier request left behind: its marks among them
    out = np.full((rows, 4), np.uint32(RUNNING_MARK).view(np.float32) if stale else 0.5,
                  np.float32)
    msg = Submit(1, "r", "tiny", None, None, None, 0.0, 0, None, per_token, alone=alone)
    r = Request(b"fe", msg, np.ones(int(offsets[-1]), np.int32), offsets, np.diff(offsets),
                out, 0.0, len(lengths))
    r.slot = SLOT
    return r


def text(r: Request, index: int) -> QueuedText:
    return QueuedText(r, index, int(r.lengths[index]))


def first_rows(r: Request):
    return r.offsets[:-1] if r.msg.per_token else slice(None)


def test_a_text_in_the_running_pass_is_marked_and_its_answered_rows_unmark_it():
    for per_token in (False, True):
        r = request([2, 3, 4], per_token, stale=True)
        _clear_marks(r.out, first_rows(r))  # the frontend, before it sends the request
        assert not _marked(r.out, first_rows(r))  # the stale marks gone
        mark_running([text(r, 1)])  # text 1's pass begins
        marks = r.out.view(np.uint32)[first_rows(r), 0] == RUNNING_MARK  # as texts' first rows
        assert marks.tolist() == [False, True, False], (per_token, marks)
        assert _marked(r.out, first_rows(r))  # a worker lost now: text 1 was running
        r.rows(1)[...] = 0.25  # the pass answered it
        assert not _marked(r.out, first_rows(r))


def test_a_request_sent_alone_shares_a_pass_with_no_other():
    limits = Limits(max_batch_size=32, max_batch_tokens=4096, max_wait_s=0.0)
    shared = [request([5, 5]), request([5])]
    alone = request([5, 5], alone=True)
    queue = [text(shared[0], 0), text(alone, 0), text(shared[1], 0), text(alone, 1),
             text(shared[0], 1)]
    passes = []
    while queue:
        batches, queue = form_pass(queue, limits)
        passes.append({id(t.request) for b in batches for t in b.texts})
    # its two texts together, every other request's texts in another pass
    assert {id(alone)} in passes and len(passes) == 2, passes


def test_a_pass_writes_its_rows_and_fails_a_request_whose_row_is_not_finite_or_did_not_fit():
    good, nan, oom = request([2, 3]), request([2, 3, 4]), request([5, 1])
    texts = [text(good, 0), text(nan, 0), text(oom, 0), text(nan, 1), text(good, 1),
             text(nan, 2), text(oom, 1)]
    out = np.arange(len(texts) * 4, dtype=np.float32).reshape(len(texts), 4)
    out[3, 2] = np.nan  # nan's second text
    ok = [True, True, False, True, True, True, True]  # oom's first text did not fit alone
    finished: list[tuple[Request, Error]] = []

    def finish(r: Request, reply: Error) -> None:
        r.done = True  # as the worker's _finish
        finished.append((r, reply))

    touched, computed = write_rows(out, ok, texts, False, "float32", finish)
    assert list(touched.values()) == [good]
    assert good.remaining == 0 and good.out.tolist() == [out[0].tolist(), out[4].tolist()]
    assert [(r, e.code) for r, e in finished] == [(oom, ErrorCode.OUT_OF_MEMORY),
                                                  (nan, ErrorCode.INTERNAL)]
    assert "5 tokens" in finished[0][1].message and "NaN or infinity" in finished[1][1].message
    # a failed request's later texts are skipped: neither written nor counted as computed
    assert nan.out[2].tolist() == [0.5] * 4 and oom.out[1].tolist() == [0.5] * 4
    assert computed == {0: 2 + 2 + 5 + 3 + 3}
