"""Engine-level launcher: N rank processes on this machine, each running one `RankWorker` (tensor
parallel), `StageWorker` (pipeline parallel) or `ExpertWorker` (expert parallel), behind pipes.

Used by `TPRunner` (standalone `LLM(tensor_parallel_size=N)` and tests); the cluster wraps the same
workers in Ray actors instead. Order: pick a free loopback port -> start N `python -m
engine.parallel.launcher <fd>` processes, each holding one end of a socketpair (a fresh interpreter, so a
caller's script needs no `if __name__ == "__main__"` guard, unlike multiprocessing's spawn) -> send each its
`RankSpec`; `_rank_main` sets one torch thread, builds the worker and answers "ready" or the traceback ->
`call(payloads)` sends one message per rank and waits for every reply, failing fast if a rank dies (its
end of the socket closes) -> `close()` asks each rank to leave, then terminates and kills what is left. A
`weakref.finalize` runs the same shutdown when the launcher is collected or the interpreter exits, so no
rank outlives its driver; a rank whose socket closes (driver gone) exits on its own. `call` and
`call_some` hold one lock from send to last reply: a KV receiver's transport thread may write chunks
(`import_kv`) while the engine thread steps, and the replies on a socket must pair with their requests.

Wire: messages are pickled plain tuples between a parent and the children it started (a trusted local
control plane, like Ray's). Tensors never cross as torch objects (torch's pickling would go through shared
memory or torch.save): step outputs carry logits as numpy arrays.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from multiprocessing.connection import Connection, wait

import torch

from engine.batch import SeqResult, StepOutput
from engine.parallel.errors import RankFailedError
from engine.parallel.expert_worker import ExpertSpec, ExpertWorker
from engine.parallel.rank_worker import RankSpec, RankWorker
from engine.parallel.stage_worker import StageSpec, StageWorker

START_TIMEOUT_S = 600.0  # import torch + read a shard, N processes sharing a few cores
STEP_TIMEOUT_S = 600.0
CLOSE_TIMEOUT_S = 10.0
KV_METHODS = ("export_kv", "import_kv")  # worker methods the driver may call besides a step


def free_port() -> int:
    """A TCP port free on loopback now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def output_to_wire(out: StepOutput | None):
    if out is None:
        return None
    assert not out.observations, "attention observation is not supported across ranks"
    return [(r.request_id, r.sampled, None if r.logits is None else r.logits.cpu().numpy()) for r in out.results]


def output_from_wire(wire) -> StepOutput:
    results = [SeqResult(rid, sampled, None if logits is None else torch.from_numpy(logits))
               for rid, sampled, logits in wire]
    return StepOutput(results)


def _send(conn: Connection, msg: tuple) -> None:
    conn.send_bytes(pickle.dumps(msg))


def build_worker(spec: RankSpec | StageSpec | ExpertSpec) -> RankWorker | StageWorker | ExpertWorker:
    """A tensor-parallel rank, a pipeline stage or an expert rank, by the spec's type."""
    if isinstance(spec, StageSpec):
        return StageWorker(spec)
    if isinstance(spec, ExpertSpec):
        return ExpertWorker(spec)
    assert isinstance(spec, RankSpec), type(spec)
    return RankWorker(spec)


def _rank_main(conn: Connection) -> None:
    """Body of a rank process: read the spec, build the worker, serve ("step", batch) until ("close",)
    or EOF (the driver is gone)."""
    torch.set_num_threads(1)  # ranks share the machine's cores: one thread each (DESIGN.md)
    worker = None
    try:
        worker = build_worker(pickle.loads(conn.recv_bytes()))
        _send(conn, ("ready", os.getpid()))
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if msg[0] == "close":
                break
            if msg[0] == "step":
                _send(conn, ("out", output_to_wire(worker.execute(msg[1]))))
            else:  # ("call", method, args): KV pages in and out of this rank's pool
                assert msg[1] in KV_METHODS, msg[1]
                _send(conn, ("out", getattr(worker, msg[1])(*msg[2])))
    except Exception:  # noqa: BLE001 - any failure goes back to the driver with its traceback
        try:
            _send(conn, ("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if worker is not None:
            worker.close()
        conn.close()


def _shutdown(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Ask, then terminate, then kill: every rank process is reaped when this returns."""
    for c in conns:
        try:
            _send(c, ("close",))
        except (OSError, ValueError):
            pass
    for p in procs:
        try:
            p.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for c in conns:
        c.close()


def _start(spec: RankSpec) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.launcher", str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    conn = Connection(ours.detach())
    _send(conn, spec)
    return proc, conn


class RankProcesses:
    """N local processes, rank r runs `build_worker(specs[r])`."""

    def __init__(self, specs: list[RankSpec | StageSpec | ExpertSpec]):
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns)
        self._lock = threading.Lock()  # one caller at a time (engine thread, KV transport threads)
        try:
            for spec in specs:
                proc, conn = _start(spec)
                self.procs.append(proc)
                self.conns.append(conn)
            self.pids = [reply[1] for reply in self._gather(START_TIMEOUT_S)]
        except BaseException:
            self.abort()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def call(self, payloads: list) -> list:
        """Send payloads[r] to rank r as ("step", payload); every rank's reply value, by rank."""
        with self._lock:
            return self._call(payloads)

    def _call(self, payloads: list) -> list:
        if self.closed:
            raise RankFailedError(0, "the rank processes are shut down")
        try:
            for rank, (c, payload) in enumerate(zip(self.conns, payloads)):
                try:
                    _send(c, ("step", payload))
                except OSError:
                    raise RankFailedError(rank, "connection closed: the rank process died") from None
            return [reply[1] for reply in self._gather(STEP_TIMEOUT_S)]
        except BaseException:
            self.abort()  # ranks left mid-collective cannot continue: take the replica down
            raise

    def call_some(self, method: str, args: dict[int, tuple]) -> dict[int, object]:
        """Call `method` (one of KV_METHODS) on the ranks named in `args`; their return values."""
        assert method in KV_METHODS, method
        with self._lock:
            return self._call_some(method, args)

    def _call_some(self, method: str, args: dict[int, tuple]) -> dict[int, object]:
        if self.closed:
            raise RankFailedError(0, "the rank processes are shut down")
        try:
            for rank, a in args.items():
                try:
                    _send(self.conns[rank], ("call", method, a))
                except OSError:
                    raise RankFailedError(rank, "connection closed: the rank process died") from None
            replies = self._gather(STEP_TIMEOUT_S, list(args))
            return {rank: reply[1] for rank, reply in zip(args, replies)}
        except BaseException:
            self.abort()
            raise

    def _gather(self, timeout: float, ranks: list[int] | None = None) -> list:
        """One reply per rank (all, or `ranks`, in that order); a dead rank's socket reads EOF, which
        `_recv` turns into RankFailedError."""
        ranks = list(range(len(self.conns))) if ranks is None else ranks
        replies: dict[int, tuple] = {}
        while len(replies) < len(ranks):
            pending = {self.conns[r]: r for r in ranks if r not in replies}
            ready = wait(list(pending), timeout)
            if not ready:
                raise RankFailedError(min(pending.values()), f"no reply within {timeout:.0f} s")
            for conn in ready:
                rank = pending[conn]
                reply = self._recv(conn, rank)
                if reply[0] == "error":
                    raise RankFailedError(rank, reply[1])
                replies[rank] = reply
        return [replies[r] for r in ranks]

    @staticmethod
    def _recv(conn: Connection, rank: int) -> tuple:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise RankFailedError(rank, "connection closed: the rank process died") from None

    def close(self) -> None:
        """Ask every rank to leave, wait, then terminate what is left (idempotent)."""
        self._finalizer()

    def abort(self) -> None:
        """After a failure: the others may wait inside a collective for the lost rank, so no asking."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        self._finalizer()


if __name__ == "__main__":  # a rank process: argv[1] is its end of the driver's socketpair
    _rank_main(Connection(int(sys.argv[1])))
