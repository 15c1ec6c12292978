"""Reward calls in worker processes: a hung scorer is killed at its deadline, a crashing one costs only its worker.

A ScoreCall is one call of a reward function (one response for verl's shape, a batch for TRL's). `run_call` runs
it and checks what it returned; its Outcome is a score per item or an error of one kind:
    timeout     the call ran past its deadline (its worker is killed)
    crash       the worker died during the call (os._exit, a segfault, the out-of-memory killer)
    exception   the function raised
    non_number  it returned NaN/inf, a string, a dict without a numeric 'score', or a list of the wrong length

RewardPool runs calls on `num_workers` processes, each fed one call at a time through its own pipe. Workers come
from a forkserver: forking the trainer itself (running torch threads, maybe CUDA) is unsafe, and spawn would
import torch again in every worker; the forkserver is a fresh process that only imports the reward modules, once,
so a worker forks from it in milliseconds. Workers start at the first call, are reused across steps, and a
killed or dead worker's slot gets a fresh one at its next call. close() (also run when the pool is
garbage-collected or the interpreter exits) stops them all; a worker also exits by itself when the trainer dies.
"""

import functools
import importlib.util
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Literal

from tlt.schema import UserError

ErrorKind = Literal["timeout", "crash", "exception", "non_number"]
# Budget for a worker to start and unpickle a call (which imports the function's module) before the call's own
# timeout starts: imports are not the scorer's time, but an import that hangs must not hang the trainer.
LOAD_TIMEOUT_S = 120.0


class RewardError(UserError, RuntimeError):
    """A reward function failed and reward.errors_fatal is set, or it cannot be called at all."""


class NonNumberError(ValueError):
    """A reward function returned something other than a finite number, None or a dict with a 'score'."""


@dataclass(frozen=True)
class FileFunction:
    """A function named by file and name (reward.custom_function): each process loads the file itself, because
    the module it defines is not importable by name."""
    path: str
    name: str

    def load(self) -> Callable[..., Any]:
        return _load_file_function(self.path, self.name)


@functools.lru_cache(maxsize=None)
def _load_file_function(path: str, name: str) -> Callable[..., Any]:
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"tlt_custom_reward_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@dataclass
class ScoreCall:
    fn: Callable[..., Any] | FileFunction
    args: tuple
    kwargs: dict[str, Any]
    num_items: int | None  # None: fn returns one score (verl shape); n: a list of n scores (TRL shape)
    timeout_s: float


@dataclass
class Outcome:
    scores: list[tuple[float | None, dict[str, Any]]] | None = None  # (score, extra keys of a dict return) per item
    error_kind: ErrorKind | None = None
    error: str = ""  # "<ExceptionType>: <message>" or what went wrong


def to_score(value: Any) -> tuple[float | None, dict[str, Any]]:
    """(score, extra) from a number, None (no ground truth) or a dict with 'score'; NonNumberError otherwise."""
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise NonNumberError(f"dict reward must have a 'score' key, got keys {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if value is None:
        return None, extra
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        raise NonNumberError(f"reward must be a number, None or a dict with 'score', got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise NonNumberError(f"reward is not finite: {value}")
    return float(value), extra


def run_call(call: ScoreCall) -> Outcome:
    """Call the function and check its return value (in a worker, or in the trainer's process with num_workers=0).
    A worker has loaded a FileFunction into the function itself before."""
    try:
        value = call.fn(*call.args, **call.kwargs)
    except Exception as e:  # the scorer's failure is the sample's error, not the trainer's
        return Outcome(error_kind="exception", error=f"{type(e).__name__}: {e}")
    try:
        if call.num_items is None:
            return Outcome(scores=[to_score(value)])
        if not isinstance(value, (list, tuple)) or len(value) != call.num_items:
            raise NonNumberError(f"batched reward must return a list of {call.num_items} values, got {value!r:.80}")
        return Outcome(scores=[to_score(v) for v in value])
    except NonNumberError as e:
        return Outcome(error_kind="non_number", error=f"NonNumberError: {e}")


def _exit_with_trainer(lifeline: Connection) -> None:
    """A worker's watchdog thread: nothing is ever sent on the lifeline, so its read returns only when the trainer,
    which holds the only write end, has died (even by SIGKILL); then the worker exits, even in the middle of a call."""
    try:
        lifeline.recv_bytes()
    except EOFError:
        pass
    os._exit(1)


def _worker_main(conn: Connection, lifeline: Connection) -> None:
    """Worker loop: receive a pickled call, say it is running, reply with its Outcome; exit when the pipe closes."""
    threading.Thread(target=_exit_with_trainer, args=(lifeline,), daemon=True, name="tlt-reward-lifeline").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        try:  # imports (the function's module, a custom file) are not the call's time: done before "running"
            call = pickle.loads(data)
            if isinstance(call.fn, FileFunction):
                call.fn = call.fn.load()
        except Exception as e:  # the function's module cannot be imported here
            conn.send(("load_error", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("running", None))
        outcome = run_call(call)
        try:
            payload = pickle.dumps(("done", outcome))
        except Exception as e:  # e.g. an unpicklable value among a dict return's extra keys
            bad = Outcome(error_kind="non_number", error=f"the reward cannot be sent back: {type(e).__name__}: {e}")
            payload = pickle.dumps(("done", bad))
        conn.send_bytes(payload)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection


@dataclass
class _Running:
    index: int  # of the call
    deadline: float  # time.monotonic(); the load budget until the worker says "running", then the call's timeout
    started: bool = False


def _fn_name(fn: Callable[..., Any] | FileFunction) -> str:
    if isinstance(fn, FileFunction):
        return f"{fn.path}:{fn.name}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _stop(worker: _Worker, grace_s: float = 0.0) -> None:
    """Close the worker's pipe (it exits on EOF), wait up to grace_s, then kill it and reap it."""
    worker.conn.close()
    if grace_s:
        worker.process.join(grace_s)
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join()


def _close_workers(workers: list[_Worker | None]) -> None:
    for slot, worker in enumerate(workers):
        if worker is not None:
            _stop(worker, grace_s=1.0)
            workers[slot] = None


class RewardPool:
    """`num_workers` reward worker processes; run(calls) returns one Outcome per call, in order."""

    def __init__(self, num_workers: int, preload: tuple[str, ...] = ()):
        if num_workers < 1:
            raise ValueError(f"RewardPool needs num_workers >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.preload = preload  # modules the forkserver imports once, so that workers start warm
        self.workers: list[_Worker | None] = [None] * num_workers
        self._lock = threading.Lock()  # one run() at a time: a slot's pipe carries one call
        # Workers are the forkserver's children, and it outlives a killed trainer while they live, so they watch
        # the trainer themselves: its death closes the lifeline's write end (only the trainer holds it).
        self._lifeline: tuple[Connection, Connection] | None = None
        self._close = weakref.finalize(self, _close_workers, self.workers)

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.process.pid for w in self.workers if w is not None]

    def close(self) -> None:
        """Stop every worker (they exit on EOF; one still busy is killed). The pool restarts them if used again."""
        with self._lock:
            _close_workers(self.workers)

    def run(self, calls: list[ScoreCall]) -> list[Outcome]:
        payloads = [self._pickle(call) for call in calls]  # unpicklable functions fail here, before any work
        outcomes: list[Outcome | None] = [None] * len(calls)
        with self._lock:
            running: dict[int, _Running] = {}  # slot -> its call
            try:
                self._run(calls, payloads, outcomes, running)
            except BaseException:  # a load error or Ctrl-C: calls still in flight must not answer the next run()
                for slot in running:
                    if self.workers[slot] is not None:
                        _stop(self.workers[slot])
                        self.workers[slot] = None
                raise
        return outcomes

    def _run(self, calls: list[ScoreCall], payloads: list[bytes], outcomes: list[Outcome | None],
             running: dict[int, _Running]) -> None:
        """Feed idle slots, wait for a reply, a death or the nearest deadline; repeat until every call is done."""
        todo = deque(range(len(calls)))
        while todo or running:
            for slot in range(self.num_workers):
                if todo and slot not in running:
                    i = todo.popleft()
                    running[slot] = _Running(i, time.monotonic() + LOAD_TIMEOUT_S)
                    try:
                        self._worker(slot).conn.send_bytes(payloads[i])
                    except OSError:  # it died starting up: its sentinel is ready and _receive says why
                        pass
            timeout = max(0.0, min(r.deadline for r in running.values()) - time.monotonic())
            ready = set(wait([x for s in running for x in (self.workers[s].conn, self.workers[s].process.sentinel)],
                             timeout))
            for slot, run in list(running.items()):
                worker = self.workers[slot]
                outcome = None
                if worker.conn in ready or worker.process.sentinel in ready:
                    outcome = self._receive(slot, run, calls[run.index])
                if outcome is None and time.monotonic() >= run.deadline:
                    _stop(worker)
                    self.workers[slot] = None
                    what = (f"timed out after {calls[run.index].timeout_s:g}s" if run.started else
                            f"timed out: the worker did not start the call within {LOAD_TIMEOUT_S:g}s")
                    outcome = Outcome(error_kind="timeout", error=what)
                if outcome is not None:
                    outcomes[run.index] = outcome
                    del running[slot]

    def _pickle(self, call: ScoreCall) -> bytes:
        try:
            return pickle.dumps(call)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise RewardError(
                f"reward function {_fn_name(call.fn)} cannot be sent to a reward worker process "
                f"({type(e).__name__}: {e}). "
                "Define it at the top level of an importable module (not a lambda or a nested function), or pass "
                "it as reward.custom_function=path/to/file.py:function_name, or set reward.num_workers=0 to score "
                "in the trainer's process (where a hung scorer cannot be killed)") from None

    def _worker(self, slot: int) -> _Worker:
        """The slot's worker, started if it has none."""
        if self.workers[slot] is None:
            ctx = _context(self.preload)
            if self._lifeline is None:
                self._lifeline = ctx.Pipe(duplex=False)  # (read end for the workers, write end kept here)
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=_worker_main, args=(child_conn, self._lifeline[0]), name=f"tlt-reward-{slot}",
                                  daemon=True)
            process.start()
            child_conn.close()  # the worker holds the only other end: its death reads as EOF here
            self.workers[slot] = _Worker(process, parent_conn)
        return self.workers[slot]

    def _receive(self, slot: int, run: _Running, call: ScoreCall) -> Outcome | None:
        """Read the worker's messages: the Outcome once the call is done, None while it runs; a dead worker is a
        crash."""
        worker = self.workers[slot]
        try:
            while worker.conn.poll():
                kind, body = worker.conn.recv()
                if kind == "load_error":
                    raise RewardError(f"a reward worker process cannot load reward function {_fn_name(call.fn)}: "
                                      f"{body}. Define it in a module the workers can import (not in an interactive "
                                      "session's __main__), or use reward.custom_function=path/to/file.py:name")
                if kind == "done":
                    return body
                run.started, run.deadline = True, time.monotonic() + call.timeout_s
            if worker.process.is_alive():
                return None
        except (EOFError, OSError):
            pass
        _stop(worker)
        self.workers[slot] = None
        reason = _exit_reason(worker.process.exitcode)
        if not run.started:  # it died starting up or loading the function: no call would succeed
            raise RewardError(f"a reward worker process died before it could call {_fn_name(call.fn)} ({reason}; "
                              "its error is printed above). A script that trains at import time must do so under "
                              "`if __name__ == '__main__':` (worker processes import the main module); "
                              "reward.num_workers=0 scores in the trainer's process instead")
        return Outcome(error_kind="crash", error=f"reward worker process died ({reason})")


def _context(preload: tuple[str, ...]) -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # takes effect when the (process-wide) forkserver first starts
    return ctx
