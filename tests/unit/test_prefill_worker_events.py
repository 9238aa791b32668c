"""A prefill worker's reports settled outside a step reach the router: `cancel` of one request polls the
sender, which can settle another request's finished push there (its transfer_done appended while the loop runs a
command); the worker must then still have work, so that the next step returns that report. Before the fix the
worker went idle with the report queued, and the router held that flight's finish until its 60 s deadline
(test_faults_memory took 124-245 s instead of 4 s in 2 of 13 suite runs; reproduced in 2 of ~45 fault cycles)."""
from __future__ import annotations

from kv_transfer.contract import TransferState, TransferStatus
from kv_transfer.fake_transport import FakeTransport
from tests.cluster_helpers import TinyCluster


def test_a_report_settled_by_a_command_keeps_the_worker_stepping_until_it_is_out(tiny_dir):
    w = TinyCluster(tiny_dir).prefill(FakeTransport())
    try:
        assert not w.has_work()
        w.cancel("unknown")  # a command with nothing to settle leaves the worker idle
        assert not w.has_work()
        w._on_end("r1", TransferStatus(TransferState.DONE, bytes=64, chunks=1))  # as `cancel` -> `sender.poll` does
        assert w.has_work(), "a settled push's report is queued: the loop must step to publish it"
        events = w.step()
        assert [(e.request_id, e.kind) for e in events] == [("r1", "transfer_done")]
        assert not w.has_work() and w.step() == []
    finally:
        w.close()
