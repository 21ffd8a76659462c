"""Where a stage's units of work run: in this process (the default), or on Ray workers, locally or on a cluster.

A stage splits its job into *units* (a problem, a cell's batch of problems, a group of traces to label). The serial
backend runs them one after another with one worker in this process. The Ray backend starts ``workers`` Ray actors;
each builds its worker once (``make_worker()``: loads the model) and then takes units one at a time
(``work(worker, unit)``), so fast workers take more. Either way only this process, the *driver*, sees the results:
it calls ``on_result`` for each unit in unit order (results that finish early wait for the earlier ones), so the
driver alone writes the run directory and the output file is the one a serial run writes, record for record; the
run directory's lock, identity check and resume (`core.rundir`) work unchanged.

Faults: a worker that dies mid-unit (killed, out of memory, its machine gone) loses nothing; a new actor replaces it
and the unit is run again, up to `BackendConfig.max_retries` times, then the run stops with one line. An exception
raised by ``work`` is a bug or bad input, not a fault: it is raised in the driver at once, not retried. A driver that
stops early (an error, Ctrl-C, SIGTERM) first saves the units that had finished ahead of an earlier one, out of unit
order; a driver that dies takes its workers with it. Either way rerunning the command resumes from the run directory
as after a serial crash.

How a stage plugs in::

    def load_worker(config: StageConfig) -> Worker: ...      # module level: loads the model once per worker
    def work(worker: Worker, unit: Unit) -> Result: ...      # module level: reads no file, writes nothing

    add_backend_arguments(parser)                            # --backend, --address, --workers, ...
    backend = BackendConfig.from_flags(vars(args))
    with RunDir(out, identity) as run, connected(backend):   # a bad --address fails before anything is written
        ...
        run_units(units, functools.partial(load_worker, config), work, backend,
                  on_result=lambda unit, result: store.append(...),     # the only writer
                  progress=lambda unit, result: bar.update(...),        # as units finish, in any order
                  local_worker=worker)                                  # optional: the serial backend's worker

``make_worker`` and ``work`` travel to other processes by pickle: module-level functions, or `functools.partial`
of one over dataclass configs; units and results are plain data (dataclasses, lists, numpy arrays). Anything the
driver read from a file travels inside the unit, since a worker on another machine cannot read the driver's files.
A CLI run as ``python -m pkg.module`` ends with ``from pkg.module import main`` in its ``__main__`` block, so the
functions it hands out pickle by module name rather than as copies of ``__main__``.

Ray is optional (``pip install 'kvscope[ray]'``) and imported only by the Ray backend.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import socket
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from core.cli import non_negative_float, positive_int
from core.errors import UsageError, unknown_choice
from core.limits import Footprint, cpu_count

BACKENDS = ("serial", "ray")
CONNECT_TIMEOUT_S = 10
# Ray counts resources in steps of 1/10000 and refuses a smaller nonzero reservation.
RAY_RESOURCE_STEP = 1e-4
# Workers a core may host: each is a process holding its own model, so beyond a few per core they only take turns
# on it (a worker that drives a GPU mostly waits, which is what the few allow), and Ray times out starting hundreds.
WORKERS_PER_CPU = 4

U = TypeVar("U")
W = TypeVar("W")
R = TypeVar("R")


class WorkerLost(UsageError):
    """A unit whose Ray workers kept dying. Reported like bad input (one line, exit status 2): the remedy is the
    user's (memory, a node, smaller units), and the finished units are saved for a rerun to resume."""


@dataclass(frozen=True)
class BackendConfig:
    """Where units run. The serial backend takes none of the Ray settings; records never depend on any of them."""

    backend: str = "serial"
    address: str | None = None  # a Ray cluster to join (host:port, ray://host:port, auto); None: a local instance
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    max_retries: int = 3  # times one unit may lose its worker before the run stops

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise unknown_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.workers, int) or self.workers < 1:
            raise UsageError(f"--workers must be a positive integer, got {self.workers!r}")
        if self.gpus_per_worker < 0 or self.cpus_per_worker < 0:
            raise UsageError(f"--gpus-per-worker and --cpus-per-worker must be >= 0, got {self.gpus_per_worker} "
                             f"and {self.cpus_per_worker}")
        for flag, each in (("--cpus-per-worker", self.cpus_per_worker), ("--gpus-per-worker", self.gpus_per_worker)):
            steps = each / RAY_RESOURCE_STEP
            if each and (steps < 1 or abs(steps - round(steps)) > 1e-6):
                step = f"{RAY_RESOURCE_STEP:.4f}"
                raise UsageError(f"{flag} {each:.10f}".rstrip("0") + f" is not a reservation Ray can make: it counts "
                                 f"resources in steps of {step}; give 0 or a multiple of {step}")
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise UsageError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if self.backend == "serial":
            ray_only = ("address", "workers", "gpus_per_worker", "cpus_per_worker")
            for f in (f for f in dataclasses.fields(self) if f.name in ray_only):
                if getattr(self, f.name) != f.default:
                    flag = "--" + f.name.replace("_", "-")
                    raise UsageError(f"{flag} {getattr(self, f.name)} needs --backend ray (the serial backend runs "
                                     "one worker in this process)")
        elif importlib.util.find_spec("ray") is None:
            raise UsageError("--backend ray needs Ray, which is not installed: pip install 'kvscope[ray]'")
        elif self.address is None:  # a local instance: its capacity is this machine's, known before Ray starts
            _check_capacity(self, local_resources(self))

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> BackendConfig:
        """The backend among a CLI's parsed flags (`add_backend_arguments`)."""
        return cls(**{f.name: flags[f.name] for f in dataclasses.fields(cls) if f.name in flags})

    @property
    def local_workers(self) -> int:
        """The Ray workers started on this machine (a local instance's); 0 for the serial backend and a cluster."""
        return self.workers if self.backend == "ray" and self.address is None else 0

    def footprint(self, driver: Footprint, worker: Footprint) -> Footprint:
        """What this machine holds: the driver's own `driver` footprint, and `worker` once per Ray worker started
        here (each loads its own model); the serial backend's driver is its worker, a cluster's workers run on its
        machines."""
        if self.backend == "serial":
            return worker
        return driver + worker.times(self.local_workers) if self.local_workers else driver


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--address``, ``--workers``, ``--gpus-per-worker``, ``--cpus-per-worker``."""
    parser.add_argument("--backend", default="serial", choices=BACKENDS,
                        help="where the units of work run: serial = one after another in this process (default); "
                        "ray = on --workers Ray workers, each loading the model once; the records are the same")
    parser.add_argument("--address", default=None,
                        help="with --backend ray: the Ray cluster to join (HOST:PORT of its head, ray://HOST:PORT, "
                        "or 'auto' for the one `ray start` made on the local machine); default: start a local Ray "
                        "instance for this run")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="with --backend ray: how many workers, each holding its own copy of the model "
                        "(default: 1)")
    parser.add_argument("--gpus-per-worker", type=non_negative_float, default=0.0,
                        help="with --backend ray: GPUs each worker reserves (0.5 puts two workers on one GPU; "
                        "default: 0)")
    parser.add_argument("--cpus-per-worker", type=non_negative_float, default=1.0,
                        help="with --backend ray: CPU cores each worker reserves; its torch threads follow "
                        "(default: 1)")


@contextlib.contextmanager
def connected(config: BackendConfig) -> Iterator[None]:
    """Start (no `address`) or join the Ray instance of `config` and check it can place every worker; a one-line
    `UsageError` otherwise. Nothing for the serial backend. A Ray instance already running in this process is used
    as it is; one started here is shut down on exit."""
    if config.backend == "serial":
        yield
        return
    import ray

    started = not ray.is_initialized()
    if started:
        _start_or_join(config)
    try:
        _check_capacity(config, ray.cluster_resources())
        yield
    finally:
        if started:
            ray.shutdown()


def _start_or_join(config: BackendConfig) -> None:
    import logging

    import ray

    where = _describe_cluster(config)
    if config.address is not None and ":" in config.address and "://" not in config.address:
        host, _, port = config.address.rpartition(":")
        try:  # Ray itself retries an unreachable address for minutes
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as err:
            raise UsageError(f"--address {config.address!r}: cannot reach a Ray head there ({err}); start one with "
                             "`ray start --head` or give its HOST:PORT") from None
    try:
        # Workers' output stays in Ray's session logs on each node (session_latest/logs): the driver's terminal
        # holds the progress bar; a worker's exceptions come back with their results.
        ray.init(address=config.address or "local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise UsageError(f"cannot start or join {where}: {str(err).strip().splitlines()[0]}") from None


def _describe_cluster(config: BackendConfig) -> str:
    return "a local Ray instance" if config.address is None else f"the Ray cluster at {config.address}"


def local_resources(config: BackendConfig) -> dict[str, float]:
    """The CPUs (and, when workers reserve some, GPUs) a local Ray instance would offer: this machine's."""
    resources = {"CPU": float(cpu_count())}
    if config.gpus_per_worker > 0:
        import torch

        resources["GPU"] = float(torch.cuda.device_count())
    return resources


def _check_capacity(config: BackendConfig, resources: Mapping[str, float]) -> None:
    """Refuse a request the cluster cannot place, rather than wait forever for workers that never start: more
    workers than `WORKERS_PER_CPU` per core, or reservations beyond its CPUs or GPUs."""
    cpus = resources.get("CPU", 0.0)
    if config.workers > WORKERS_PER_CPU * cpus:
        raise UsageError(f"--workers {config.workers} is more than {_describe_cluster(config)} can run: it has "
                         f"{cpus:g} CPU cores, room for {WORKERS_PER_CPU * cpus:g} workers ({WORKERS_PER_CPU} per "
                         "core, each holding its own model); lower --workers")
    for kind, each, flag in (("CPU", config.cpus_per_worker, "--cpus-per-worker"),
                             ("GPU", config.gpus_per_worker, "--gpus-per-worker")):
        have = resources.get(kind, 0.0)
        if config.workers * each > have + 1e-9:
            raise UsageError(f"--workers {config.workers} with {flag} {each:g} needs {config.workers * each:g} "
                             f"{kind}s; {_describe_cluster(config)} has {have:g}; lower --workers or {flag}")


def run_units(
    units: Sequence[U],
    make_worker: Callable[[], W],
    work: Callable[[W, U], R],
    config: BackendConfig,
    *,
    on_result: Callable[[U, R], None],
    progress: Callable[[U, R], None] | None = None,
    local_worker: W | None = None,
) -> None:
    """Run ``work(worker, unit)`` for every unit and hand each result to ``on_result`` in unit order, in the driver;
    a run stopped early (an error, an interrupt) first hands over, in unit order, the results that had finished
    ahead of a unit still running, so that nothing finished is lost.

    `progress` sees each result as it arrives, after the commits it allowed (with several workers a result that
    arrives early is shown before it is committed). The serial backend uses
    `local_worker` when given (a model the driver has already loaded), else calls `make_worker` once.
    """
    if not units:
        return
    if config.backend == "serial":
        worker = make_worker() if local_worker is None else local_worker
        for unit in units:
            result = work(worker, unit)
            on_result(unit, result)
            if progress is not None:
                progress(unit, result)
        return
    with connected(config):
        _run_on_ray(units, make_worker, work, config, on_result, progress)


class _Host:
    """The Ray actor around one worker. A worker that cannot be built (a model missing on that machine) raises its
    error from `run`, so it reaches the driver as the stage's own error instead of as a dead actor to replace."""

    def __init__(self, make_worker: Callable[[], Any], work: Callable[[Any, Any], Any]):
        self._work = work
        self._worker, self._error = None, None
        try:
            self._worker = make_worker()
        except Exception as err:
            self._error = err

    def run(self, unit: Any) -> Any:
        if self._error is not None:
            raise self._error
        return self._work(self._worker, unit)


def _run_on_ray(units, make_worker, work, config: BackendConfig, on_result, progress) -> None:
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    host = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker, max_restarts=0)(_Host)
    actors = [host.remote(make_worker, work) for _ in range(min(config.workers, len(units)))]
    idle = list(actors)
    queue = deque(range(len(units)))
    running: dict[Any, tuple[Any, int]] = {}
    losses: Counter[int] = Counter()
    finished: dict[int, Any] = {}
    committed = 0
    try:
        while committed < len(units):
            while idle and queue:
                actor, index = idle.pop(), queue.popleft()
                # ray types a handle as `ActorHandle[_Host] | type[_Host]`, so its methods lack `.remote` to mypy
                running[actor.run.remote(units[index])] = (actor, index)  # type: ignore[union-attr]
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor, index = running.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as err:
                if err.actor_init_failed:  # the same on every attempt: kvscope missing there, say
                    raise UsageError(f"a Ray worker could not start: {_last_line(err)}; every machine of the "
                                     "cluster needs kvscope installed in the same environment") from None
                losses[index] += 1
                reason = _last_line(err)
                if losses[index] > config.max_retries:
                    raise WorkerLost(f"unit {index + 1} of {len(units)} lost its Ray worker {losses[index]} times "
                                     f"(last: {reason}); {committed} units are saved: rerun the same command to "
                                     "resume") from None
                _say(f"unit {index + 1} of {len(units)} lost its Ray worker ({reason}); running it again on a new "
                     f"worker (retry {losses[index]} of {config.max_retries})")
                ray.kill(actor)
                replacement = host.remote(make_worker, work)
                actors.append(replacement)
                idle.append(replacement)
                queue.appendleft(index)
                continue
            except RayTaskError as err:
                if isinstance(err.cause, UsageError):  # one line for the user, as in a serial run
                    raise err.cause from None
                raise
            idle.append(actor)
            finished[index] = result
            while committed in finished:
                on_result(units[committed], finished.pop(committed))
                committed += 1
            if progress is not None:
                progress(units[index], result)
    except BaseException:
        # Stopped early (a unit's error, Ctrl-C, or SIGTERM, which Ray's driver turns into SystemExit): the units
        # that finished while an earlier one still ran are saved too, out of unit order, so a resume skips them.
        for index in sorted(finished):
            on_result(units[index], finished.pop(index))
        raise
    finally:
        for actor in actors:
            ray.kill(actor)  # type: ignore[arg-type]  # an actor handle, typed by ray as above


def _last_line(err: Exception, width: int = 200) -> str:
    """The line of a Ray error that says what happened (its last), cut to `width` characters."""
    line = str(err).strip().splitlines()[-1].strip()
    return line if len(line) <= width else line[: width - 1] + "…"


def _say(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)
