"""A job that learns its drafter while it runs (`drafter.learn`, docs/design.md §2.2).

- Each replica records the trajectory of every row it decodes with the decode loop's trace
  (`spot.drafters.trajectory.TrajectoryRecorder`: the target's own states and logits of the
  forwards it takes anyway) and sends finished rows to the job's one `Learner` actor
  (`RowRecording`).
- The learner, an actor with CPUs of its own, runs `spot.drafters.learning.DrafterLearner`
  in a thread of its own: Spiffy first, SPOT in rounds, each measured on held-out rows. Each
  drafter it hands out (its file's bytes) is put in Ray's object store; the files and
  rounds.json go under <output.path>/drafter/.
- A replica's `DrafterWatch` polls the learner, loads each new drafter from the object
  store and puts it in the engine's `spot.drafting.DrafterSlot`: the decode loop takes it
  at its next iteration, without a restart, and tokens stay the target's own.

Every row the learner takes is also written under <output.path>/drafter/rows/ (a folder of
trajectory shards, the format `record-trajectories` writes) while it learns. A resubmit
starts from the last drafter handed out (rounds.json) and, unless the learner had stopped,
from every row recorded before: its rounds come when they would have come had the job not
been stopped. The rows are removed when the learner stops. A learned file is an ordinary
drafter file of its kind, which another job can name in `drafter.path`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from pipeline.control import beside_the_driver
from pipeline.job import Job
from pipeline.output import DRAFTER_DIR

ROUNDS_FILE = "rounds.json"
ROWS_DIR = "rows"  # the rows recorded while learning, kept across runs
POLL_SECONDS = 0.5  # how often a replica asks the learner for a new drafter
# when the rows are done, how long the driver waits for a learning round in progress (its
# drafter is written, and the next run starts from it) before stopping the learner
LEARNER_CLOSE_SECONDS = 600.0


def drafter_dir(job: Job) -> Path:
    """Where a learning job writes its drafters (a local or shared folder)."""
    return Path(job.output.path.resolved) / DRAFTER_DIR


def read_rounds(job: Job) -> dict[str, Any] | None:
    """rounds.json of the job's output (None before its first round)."""
    path = drafter_dir(job) / ROUNDS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class Handout:
    """A drafter the learner hands out: `version` counts them (0: the one the job starts
    with, which may be none); `data` is the file's bytes in the object store."""

    version: int
    kind: str | None  # None: draft-free
    label: str  # the output's `drafter` column
    suffix: str = ""
    data: ray.ObjectRef | None = None

    def load(self, budget: int | None) -> tuple[Any, Any]:
        """The drafter, drafting `budget` nodes (None: its curve's largest), read from the
        object store through a temporary file (the registry reads files), and its acceptance
        curve."""
        from spot.drafters.registry import acceptance_curve, load_drafter

        with tempfile.TemporaryDirectory(prefix="spot-drafter-") as folder:
            path = Path(folder) / f"handout.{self.suffix}"
            path.write_bytes(ray.get(self.data))
            curve = acceptance_curve(self.kind, path)
            budget = max(curve.budgets) if budget is None else budget
            return load_drafter(self.kind, path, budget, None), curve


class LearnerState:
    """The learner's side of a learning job, in the `Learner` actor (see the module doc)."""

    def __init__(self, job: Job):
        # torch's optimizers import its compiler stack, which makes a cache folder under
        # TMPDIR at import: this process's own, removed when it closes
        self._scratch = tempfile.mkdtemp(prefix="spot-learner-")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", self._scratch)
        import torch

        from spot.drafters.learning import DrafterLearner

        torch.set_num_threads(max(1, round(job.drafter.learning.num_cpus)))
        self.job = job
        self.out_dir = drafter_dir(job)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        config = job.drafter.learning.learner_config()
        # its target (what a replay needs of it) comes with the first rows: the learner
        # loads no model
        self.learner = DrafterLearner(None, self.out_dir, config, job.model.path.text)
        self.seen: set[int] = set()  # request keys taken (a retried row is recorded twice)
        self.inbox: list[Any] = []
        self.rows_received = 0
        self.recording_seconds = 0.0  # the replicas', recording the rows received
        self.failed: str | None = None
        self.version = 0
        self.handout = self._start()
        self._handed = self.learner.current
        self.rows_dir = self.out_dir / ROWS_DIR
        self.rows_restored = 0  # rows an earlier run recorded, learned from again
        self._shards = 0
        self._run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="learner")
        self._thread.start()

    # -- the start ----------------------------------------------------------------------
    def _start(self) -> Handout:
        """The drafter to start from: the last one handed out by an earlier run of this
        output (its rounds restored, learning on from there unless it had stopped), else
        drafter.path, else none."""
        from spot.drafters.learning import Round
        from spot.drafters.registry import load_order_model

        learner, state = self.learner, read_rounds(self.job)
        if state is not None:
            learner.rounds = [self._round(r, Round) for r in state["rounds"]]
            learner.stopped = state["stopped"]
            adopted = [r for r in learner.rounds if r.adopted]
            learner.current = adopted[-1] if adopted else None
            spots = [r for r in learner.rounds if r.kind == "spot"]
            if spots:
                learner.model = load_order_model(spots[-1].path)[0].train()
            if learner.current is not None:
                return self._handout(learner.current)
        path = self.job.drafter_path()
        if path is None:
            return Handout(0, None, "none")
        learner.current = self._round(  # round 0: what the rounds measure against
            {
                "round": 0,
                "kind": "spot",
                "file": path,  # absolute: joined to the folder, it stays itself
                "rows": 0,
                "rows_by_slice": {},
                "metrics": {},
                "steps_per_forward_before": {},
                "steps_per_forward_after": {},
                "seconds": 0.0,
                "adopted": True,
            },
            Round,
        )
        learner.model = load_order_model(path)[0].train()
        return self._handout(learner.current, self.job.drafter_label())

    def _round(self, record: dict, round_class: type) -> Any:
        """A round of rounds.json, its file found beside it."""
        return round_class(
            number=record["round"],
            kind=record["kind"],
            path=self.out_dir / record["file"],
            rows=record["rows"],
            rows_by_slice=record["rows_by_slice"],
            metrics=record["metrics"],
            before={int(b): v for b, v in record["steps_per_forward_before"].items()},
            after={int(b): v for b, v in record["steps_per_forward_after"].items()},
            seconds=record["seconds"],
            adopted=record["adopted"],
        )

    def _handout(self, done: Any, label: str | None = None) -> Handout:
        path = Path(done.path)
        label = label or f"{done.kind}:learned round {done.number}"
        data = ray.put(path.read_bytes())
        return Handout(self.version, done.kind, label, path.suffix.lstrip("."), data)

    # -- what replicas and the driver call ----------------------------------------------
    def add(self, parts: list[Any], replay_target: Any, seconds: float) -> None:
        """Trajectories of finished rows (`Trajectories`, any number of rows each), what of
        the target a replay needs (`ReplayTarget`) and the replica's seconds spent recording
        them."""
        with self._wake:
            self.recording_seconds += seconds
            self.rows_received += len(parts)
            if self.learner.done:
                return
            self.learner.target = self.learner.target or replay_target
            self.inbox += parts
            self._wake.notify()

    def latest(self, version: int) -> dict[str, Any]:
        """The drafter handed out last, unless the caller has it (`version`), and whether
        rows are still wanted."""
        handout = self.handout
        recording = not (self.learner.done or self._closing or self.failed)
        return {"handout": handout if handout.version != version else None, "record": recording}

    def close(self, timeout: float) -> dict[str, Any]:
        """Let the round in progress finish (up to `timeout` seconds), learn nothing more
        (the rows still queued are kept for a resubmit), and return what rounds.json holds."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        shutil.rmtree(self._scratch, ignore_errors=True)
        return self.state()

    def state(self) -> dict[str, Any]:
        learner = self.learner
        current = learner.current
        return {
            "rounds": [self._record(r) for r in learner.rounds],
            "current": None if current is None else self._record(current),
            "stopped": learner.done,
            "rows": learner.rows,
            "rows_by_slice": {name: len(keys) for name, keys in learner.keys.items()},
            "rows_received": self.rows_received,
            "rows_restored": self.rows_restored,
            "recording_seconds": self.recording_seconds,
            "error": self.failed,
        }

    def _record(self, done: Any) -> dict[str, Any]:
        record = done.to_dict()
        path = Path(done.path)
        inside = path.parent == self.out_dir
        return record | {"file": path.name if inside else None, "path": str(path)}

    # -- the learning thread ------------------------------------------------------------
    def _run(self) -> None:
        import torch

        try:
            self._restore()
            while True:
                with self._wake:
                    while not (self.inbox or self._closing):
                        self._wake.wait()
                    parts, self.inbox = self.inbox, []
                for part in parts:
                    self._take(part)
                if self._closing:
                    return  # the rows taken are kept: a resubmit learns from them
                with torch.no_grad():
                    while not self._closing and (done := self.learner.learn()) is not None:
                        self._after(done)
        except Exception as error:  # learning stops; the job goes on with its drafter
            import traceback

            self.failed = f"{type(error).__name__}: {error}"
            print(f"drafter learning stopped: {traceback.format_exc()}", flush=True)

    def _restore(self) -> None:
        """The rows earlier runs of this output recorded (the learner still learning): taken
        as if they had just come, before any of this run's."""
        from spot.drafters.trajectory import SHARD_PATTERN, Trajectories

        if self.learner.done or not self.rows_dir.is_dir():
            return
        for shard in sorted(self.rows_dir.glob(SHARD_PATTERN)):
            part = self._unseen(Trajectories.load(shard))
            if part is not None:
                self.learner.add(part)
                self.rows_restored += part.key.unique().numel()

    def _take(self, part: Any) -> None:
        part = None if self.learner.done else self._unseen(part)
        if part is None:
            return
        self._shards += 1
        part.save(self.rows_dir / f"shard-{self._run_id}-{self._shards:06d}.pt")
        self.learner.add(part)

    def _unseen(self, part: Any) -> Any:
        """The rows of `part` not taken before (a retried or resubmitted row is recorded
        again), marked taken; None when there are none."""
        keys = [k for k in part.key.unique().tolist() if k not in self.seen]
        if not keys:
            return None
        self.seen.update(keys)
        return part if len(keys) == part.key.unique().numel() else _of(part, keys)

    def _after(self, done: Any) -> None:
        """Rounds are made (Spiffy's recalibration and SPOT's), their files written: hand
        out the drafter adopted, if any; rounds.json. Once learning has stopped, the rows
        kept for a resubmit go."""
        current = self.learner.current
        if current is not self._handed:
            self.version += 1
            self.handout, self._handed = self._handout(current), current
        self._write_state()
        if self.learner.done:
            shutil.rmtree(self.rows_dir, ignore_errors=True)

    def _write_state(self) -> None:
        path = self.out_dir / ROUNDS_FILE
        temporary = path.with_name(f".{path.name}.partial")
        temporary.write_text(json.dumps(self.state(), indent=1))
        os.replace(temporary, path)


def _of(part: Any, keys: list[int]) -> Any:
    from dataclasses import replace

    chosen = part.of_requests(keys)
    return replace(chosen, meta=chosen.meta | {"requests": len(keys)})


@ray.remote(num_cpus=0, max_concurrency=4)
class Learner:
    """The job's one learner (a threaded actor: replicas add rows and poll while it learns);
    made with the learning section's CPUs (`start_learner`)."""

    def __init__(self, job: Job):
        self.state = LearnerState(job)

    def add(self, parts: list[Any], replay_target: Any, seconds: float) -> None:
        self.state.add(parts, replay_target, seconds)

    def latest(self, version: int) -> dict[str, Any]:
        return self.state.latest(version)

    def close(self, timeout: float) -> dict[str, Any]:
        return self.state.close(timeout)


def start_learner(job: Job) -> ray.actor.ActorHandle:
    """The job's learner actor, with the CPUs and GPUs of `drafter.learning` (with a GPU, it
    trains there: `LearnerConfig.device`)."""
    learning = job.drafter.learning
    return Learner.options(
        num_cpus=learning.num_cpus, num_gpus=learning.num_gpus, **beside_the_driver(soft=True)
    ).remote(job)


class RowRecording:
    """A replica's recording of its rows for the learner: one `TrajectoryRecorder` per
    stream of its decode loop (`recorder`), a finished row's records taken out of it
    (`finished`) and sent in groups of `rows_per_send` rows; off once the learner says it
    wants no more."""

    def __init__(self, learner: ray.actor.ActorHandle, engine: Any):
        from spot.drafters.recipes import recording_meta
        from spot.drafters.replay import ReplayTarget

        self.learner = learner
        target, config = engine.target, engine.config
        self.meta = recording_meta(config, target, 1)
        self.replay_target = ReplayTarget.of(target)
        self.block_length = config.block_length
        self.mask_id = target.mask_id
        self.rows_per_send = engine.job.resources.batch_size
        self.on = True
        self.seconds = 0.0  # spent recording (the trace's work and taking rows out)
        self._sent_seconds = 0.0
        self.rows = 0
        self._lock = threading.Lock()
        self._buffer: list[Any] = []

    def recorder(self) -> Any:
        """A trace for the next stream (None: not recording)."""
        if not self.on:
            return None
        from spot.drafters.trajectory import TrajectoryRecorder

        return TimedTrace(TrajectoryRecorder({}, self.block_length, self.mask_id), self)

    def finished(self, trace: Any, key: int) -> None:
        start = time.perf_counter()
        part = trace.recorder.take([key], self.meta)
        with self._lock:
            self.seconds += time.perf_counter() - start
            if part is None or not self.on:
                return
            self._buffer.append(part)
            self.rows += 1
            full = len(self._buffer) >= self.rows_per_send
        if full:
            self.send()

    def send(self) -> None:
        with self._lock:
            parts, self._buffer = self._buffer, []
            seconds, self._sent_seconds = self.seconds - self._sent_seconds, self.seconds
        if parts:
            self.learner.add.remote(parts, self.replay_target, seconds)


class TimedTrace:
    """A stream's recorder, its time counted to the recording (what recording costs)."""

    def __init__(self, recorder: Any, recording: RowRecording):
        self.recorder = recorder
        self.recording = recording
        self.needs_hidden = False

    @property
    def keys(self) -> dict[int, int]:
        return self.recorder.keys

    def __call__(self, index, state, logits, successor, hidden) -> None:
        if not self.recording.on:
            return
        start = time.perf_counter()
        self.recorder(index, state, logits, successor, hidden)
        self.recording.seconds += time.perf_counter() - start


class DrafterWatch:
    """A replica's link to the learner: the drafter to start with (asked at once), then a
    thread that polls for new ones and hands them to `swap`; it turns recording off when
    the learner wants no more rows."""

    def __init__(
        self,
        learner: ray.actor.ActorHandle,
        recording: RowRecording,
        swap: Callable[[Handout], None],
    ):
        self.learner = learner
        self.recording = recording
        self.swap = swap
        self.version = -1
        self.poll()
        threading.Thread(target=self._watch, daemon=True, name="drafter-watch").start()

    def poll(self) -> None:
        answer = ray.get(self.learner.latest.remote(self.version))
        if not answer["record"]:
            self.recording.on = False
        handout = answer["handout"]
        if handout is not None:
            self.swap(handout)
            self.version = handout.version

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            try:
                self.poll()
            except ray.exceptions.RayError:
                return  # the learner is gone: the replica keeps the drafter it has
