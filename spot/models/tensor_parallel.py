"""Tensor parallelism inside one replica: the target sharded over N ranks with DeepSpeed AutoTP.

A replica with `model.tensor_parallel: N` runs N ranks, one process each. Rank 0 is the
replica itself (the Ray actor holding the engine); it spawns ranks 1..N-1 as child
processes. Every rank loads the checkpoint and shards it with `deepspeed.init_inference`
(an explicit injection policy for the native `DecoderLayer`: q/k/v/gate/up are column-sharded,
o_proj/down_proj row-sharded and all-reduced, the LM head's input split and all-reduced).
The decode loop and the drafter run on rank 0 only; every `score` call of rank 0 is first
broadcast to the other ranks (contexts opened and released since the last call, the windows,
their `keep`), so all ranks run the same forward on the same inputs and keep identical
contexts (each holds its own heads' share of the KV cache). The coupled noise is keyed by
(seed, request, step) and drawn on rank 0 from the full logits, which every rank holds after
the final all-reduce; results come from rank 0. What to load and over which ranks comes
as two small specs (`ModelSpec`, `GroupSpec`); the pipeline builds them from its job.

Why ranks spawned by the replica rather than a placement group of rank actors per replica:
- Ray already gives an actor its `num_gpus` on one node, and TP ranks must share a node (their
  all-reduce runs on every layer, over NVLink or shared memory). The spawned ranks inherit the
  actor's CUDA_VISIBLE_DEVICES and take one GPU each, so the resources Ray reserves for the
  replica (`num_gpus = tensor_parallel`) are exactly the ranks' GPUs.
- The ranks live and die with their replica: when Ray restarts a dead replica, the new one
  spawns fresh ranks; orphaned ranks exit when their parent disappears. A placement group of
  separate actors would need its own gang restart and liveness protocol.
- Rank 0 is the replica, so the logits (the large tensors) never leave its process; only the
  windows' token ids (kilobytes) cross process boundaries, over a gloo control group.
The price: Ray does not account the ranks as separate workers (the replica's `num_cpus`
covers all of them), and a replica cannot span nodes, which TP should not do anyway.

A failure inside a mirrored `score` is the input's when every rank meets it (the same point of
the same forward, inputs being equal): rank 0 raises it and the group goes on. Any other
stops the group with the failed rank's error (rank 0 prints it and exits, as when a rank
dies): a rank left alone waits in a collective forever, and one whose state differs would
compute wrong shards. Ranks 1..N-1 note their failures on a pipe to rank 0, whose watchdog
decides: rank 0 finished that score, or did not within `GroupSpec.failure_skew` seconds of
the note (it waits in a collective), means the failed rank was alone. Success costs nothing.

Process settings per rank: LOCAL_SIZE = N (DeepSpeed's shared-memory all-reduce segfaults in
the first forward without it), OMP_NUM_THREADS = the replica's CPUs / N (at least 1;
oversubscribed threads make CPU ranks many times slower), DS_ACCELERATOR=cpu and gloo on
CPU, nccl on GPU, TORCH_EXTENSIONS_DIR under a cache folder (the CPU all-reduce op is
compiled there once, ~30 s or more).
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spot.models.loading import DTYPES
from spot.target import Scores, Target, Window

logger = logging.getLogger(__name__)

# DeepSpeed's default grain: MLP and LM-head shards are multiples of it (kernel alignment)
DEFAULT_GRAIN = 64
RENDEZVOUS_TIMEOUT = timedelta(minutes=15)  # the first start compiles the CPU all-reduce op
# workers wait for the next command as long as the replica lives (it may idle between blocks)
CONTROL_TIMEOUT = timedelta(days=7)
# what deepspeed.init_inference shards on CPUs and GPUs alike (float16 runs on GPUs only);
# never float64: DeepSpeed refuses it, and its CPU shared-memory all-reduce would return
# float64 tensors unreduced on CPUs with AVX-512
SHARDED_DTYPES = ("float32", "bfloat16")


# each rank holds its own heads' KV; a prefix cache would have to be mirrored on all of them
NO_PREFIX_CACHE = "a tensor-parallel target has no prefix cache yet"


@dataclass(frozen=True)
class GroupSpec:
    """The ranks of one replica.

    degree: number of ranks; device: "cpu" (gloo) or "cuda" (nccl, one GPU per rank);
    threads: torch threads per rank; failure_skew: seconds rank 0 gives every rank to meet a
    failure of a score that one rank met (ranks run the same forward in step, so a failure of
    the input meets them all within moments of each other).
    """

    degree: int
    device: str = "cpu"
    threads: int = 1
    failure_skew: float = 30.0

    def __post_init__(self) -> None:
        if self.degree < 2:
            raise ValueError("a tensor-parallel group needs at least 2 ranks")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.failure_skew <= 0:
            raise ValueError("failure_skew must be positive")


@dataclass(frozen=True)
class ModelSpec:
    """What every rank loads: a local checkpoint directory, its family, a dtype name (a key
    of `spot.models.loading.DTYPES`)."""

    path: str
    family: str | None = None
    dtype: str = "float32"


# -- what a degree can shard ------------------------------------------------------------------
def degree_problems(checkpoint: str | Path, family: str | None, degree: int) -> list[str]:
    """Why `degree` ranks cannot shard this checkpoint (empty when they can): attention
    heads and key/value heads must split evenly over the ranks. Read from config.json alone,
    so a job is checked without loading weights or DeepSpeed."""
    from spot.models.registry import family_for

    directory = Path(checkpoint)
    raw = json.loads((directory / "config.json").read_text())
    config = family_for(family, raw).native_config(raw)
    problems = []
    for what, count in (
        ("attention heads", config.num_heads),
        ("key/value heads", config.num_kv_heads),
    ):
        if count % degree:
            problems.append(
                f"{degree} does not divide the model's {count} {what}; "
                f"use a divisor of {math.gcd(config.num_heads, config.num_kv_heads)}"
            )
    return problems


# -- sharding ---------------------------------------------------------------------------------
def row_parallel_names(model: nn.Module) -> tuple[str, ...]:
    """Names (relative to a decoder layer) of the linears whose outputs are all-reduced:
    the attention output and every MLP down projection (dense and shared experts)."""
    names = set()
    for name, module in model.named_modules():
        parts = name.split(".")  # model.layers.{i}.<name in the layer>
        in_layer = parts[:2] == ["model", "layers"] and len(parts) > 3
        if in_layer and isinstance(module, nn.Linear) and parts[-1] in ("o_proj", "down_proj"):
            names.add(".".join(parts[3:]))
    return tuple(sorted(names))


def grain_size(model: nn.Module, degree: int) -> int:
    """DeepSpeed's default grain (64) unless an MLP width cannot be split into equal
    multiples of it; then the largest power of two that can (tiny test models)."""
    widths = {
        module.out_features
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.endswith(("gate_proj", "up_proj"))
    }
    grain = DEFAULT_GRAIN
    while grain > 1 and any(w % (grain * degree) for w in widths):
        grain //= 2
    return grain


def shard_model(model: nn.Module, degree: int) -> nn.Module:
    """The model sharded in place over the current process group's `degree` ranks, through
    DeepSpeed's public `init_inference`, in the model's own dtype (DeepSpeed refuses dtypes
    its accelerator does not run, float64 among them)."""
    import deepspeed

    from spot.models.transformer import DecoderLayer

    dtype = next(model.parameters()).dtype
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": degree, "tp_grain_size": grain_size(model, degree)},
        dtype=dtype,
        replace_with_kernel_inject=False,
        injection_policy={DecoderLayer: row_parallel_names(model)},
    )
    return engine.module.eval()


def load_shard(spec: ModelSpec, degree: int, device: str):
    """This rank's DiffusionTarget: the checkpoint loaded on CPU, sharded, moved to the
    rank's device by DeepSpeed."""
    from spot.models.loading import load_model
    from spot.models.target import DiffusionTarget

    loaded = load_model(spec.path, spec.family, DTYPES[spec.dtype], "cpu")
    model = shard_model(loaded.model, degree)
    if device == "cuda":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return DiffusionTarget(model, loaded.decoding)


def sharded_target(model: ModelSpec, group: GroupSpec) -> ShardedTarget:
    """`model` sharded over the ranks `group` describes, this process being rank 0 (the
    other ranks are started here and stop with `target.group.close()` or this process)."""
    return TensorParallelGroup(group).load(model)


# -- the ranks of one replica -----------------------------------------------------------------
def extensions_dir() -> str:
    """Where DeepSpeed compiles its CPU all-reduce op: $TORCH_EXTENSIONS_DIR, else a cache
    folder of this project."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(default / "spot-pipeline" / "torch_extensions")
    )


def rank_environment(group: GroupSpec, rank: int, port: int) -> dict[str, str]:
    """Environment variables a rank needs before DeepSpeed is imported."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(group.degree),
        "LOCAL_SIZE": str(group.degree),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(group.threads),
        "TORCH_EXTENSIONS_DIR": extensions_dir(),
    }
    if group.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Ranks:
    """This process's membership in the group: DeepSpeed's process group plus a gloo group
    for commands from rank 0."""

    def __init__(self, group: GroupSpec, rank: int):
        import deepspeed

        self.group = group
        self.rank = rank
        torch.set_num_threads(group.threads)
        if group.device == "cuda":
            torch.cuda.set_device(rank)
        deepspeed.init_distributed(
            dist_backend="nccl" if group.device == "cuda" else "gloo",
            verbose=False,
            timeout=RENDEZVOUS_TIMEOUT,
            rank=rank,
            world_size=group.degree,
        )
        self.control = torch.distributed.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def broadcast(self, command: Any) -> Any:
        """Rank 0 sends `command`; every rank returns it."""
        box = [command]
        torch.distributed.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


@dataclass(frozen=True)
class _Load:
    target: int
    model: ModelSpec


@dataclass(frozen=True)
class _Score:
    target: int
    opened: list[tuple[int, torch.Tensor, int]]  # (context id, prompt [P], total length)
    released: list[int]  # context ids rank 0 no longer holds
    contexts: list[int]  # context ids in the order `score` received them
    windows: list[Window]
    block_length: int
    output_hidden: bool
    after_failure: bool  # rank 0's previous score failed, on every rank


class ShardedContext:
    """Rank 0's handle of a context that every rank holds under the same id."""

    def __init__(self, ident: int, local: Any):
        self.ident = ident
        self.local = local


@dataclass
class _Mirror:
    """What rank 0 owes the other ranks about one target since its last broadcast."""

    opened: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    next_id: int = 0


class ShardedTarget:
    """The Target protocol on rank 0: every call that runs the model is mirrored on all ranks.

    Contexts are opened on rank 0 at once and on the other ranks with the next `score`;
    when rank 0 drops a context, the next `score` tells the other ranks to drop theirs."""

    def __init__(self, group: TensorParallelGroup, ident: int, local):
        self.group = group
        self.ident = ident
        self.local = local
        for name in Target.__annotations__:  # the protocol's attributes, as rank 0 has them
            setattr(self, name, getattr(local, name))
        self.prefix_cache_problem = NO_PREFIX_CACHE
        self.degree = group.spec.degree
        self._mirror = _Mirror()

    def open(self, prompt: torch.Tensor, total_length: int) -> ShardedContext:
        context = ShardedContext(self._mirror.next_id, self.local.open(prompt, total_length))
        self._mirror.next_id += 1
        self._mirror.opened.append((context.ident, prompt.to(torch.long).cpu(), total_length))
        weakref.finalize(context, self._mirror.released.append, context.ident)
        return context

    def committed_length(self, context: ShardedContext) -> int:
        return self.local.committed_length(context.local)

    def score(
        self,
        contexts: Sequence[ShardedContext],
        windows: Sequence[Window],
        block_length: int,
        output_hidden: bool = False,
    ) -> Scores:
        mirror = self._mirror
        opened, released = list(mirror.opened), list(mirror.released)
        del mirror.opened[: len(opened)], mirror.released[: len(released)]
        cpu_windows = [Window(w.context, w.tokens.cpu(), w.keep) for w in windows]
        command = _Score(
            self.ident,
            opened,
            released,
            [c.ident for c in contexts],
            cpu_windows,
            block_length,
            output_hidden,
            self.group.ledger.last_failed,
        )
        self.group.send(command)
        ledger = self.group.ledger
        number = ledger.start()
        try:
            scores = self.local.score(
                [c.local for c in contexts], windows, block_length, output_hidden
            )
        except Exception as error:
            ledger.failed(number, f"{type(error).__name__}: {error}")
            raise
        ledger.succeeded(number)
        return scores

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding is not sharded; rank 0 answers alone."""
        return self.local.embed(tokens)


class TensorParallelGroup:
    """Rank 0 of a replica's ranks, in this process; ranks 1..N-1 are child processes.

    `load` shards a checkpoint over all ranks and returns its rank-0 target; `close` (also
    run at interpreter exit) stops the children."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.port = _free_port()
        self.targets: list[ShardedTarget] = []
        os.environ.update(rank_environment(spec, 0, self.port))
        if spec.device == "cpu":
            _build_cpu_all_reduce()  # once, here, before the children would race for it
        notes = {rank: os.pipe() for rank in range(1, spec.degree)}  # (read, write) ends
        self.children = [self._spawn(rank, notes[rank][1]) for rank in notes]
        for _, write in notes.values():
            os.close(write)
        pipes = {rank: read for rank, (read, _) in notes.items()}
        self.ledger = _Ledger(self.children, pipes, spec.failure_skew)
        self._closing = threading.Event()
        threading.Thread(target=_watch, args=(self.ledger, self._closing), daemon=True).start()
        self.ranks = _Ranks(spec, 0)
        self._closed = False
        weakref.finalize(self, _abandon, self.children, self._closing)  # never closed

    def _spawn(self, rank: int, notes: int) -> subprocess.Popen:
        env = {**os.environ, **rank_environment(self.spec, rank, self.port)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        module = "spot.models.tensor_parallel"
        command = [sys.executable, "-m", module, json.dumps(asdict(self.spec)), str(rank)]
        return subprocess.Popen([*command, str(notes)], env=env, pass_fds=(notes,))

    def send(self, command: Any) -> None:
        self.ranks.broadcast(command)

    def load(self, model: ModelSpec) -> ShardedTarget:
        if model.dtype not in SHARDED_DTYPES:  # refused here, before the other ranks load it
            raise ValueError(
                f"tensor parallelism runs {' or '.join(SHARDED_DTYPES)}, not {model.dtype}"
            )
        ident = len(self.targets)
        self.send(_Load(ident, model))
        local = load_shard(model, self.spec.degree, self.spec.device)
        target = ShardedTarget(self, ident, local)
        self.targets.append(target)
        return target

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        try:
            if all(c.poll() is None for c in self.children):
                self.ranks.broadcast(None)
        finally:
            _stop_processes(self.children)
            torch.distributed.destroy_process_group()


class _Ledger:
    """Rank 0's account of the mirrored scores: its own outcome of each, and the failures
    the other ranks note on their pipes. Shared by rank 0's thread and its watchdog."""

    def __init__(self, children: list[subprocess.Popen], pipes: dict[int, int], skew: float):
        self.children = children
        self.pipes = pipes  # rank -> read end of its notes
        self.skew = skew  # GroupSpec.failure_skew
        self.partial = {rank: b"" for rank in pipes}
        self.changed = threading.Condition()
        self.sent = 0  # scores started on every rank
        self.running: int | None = None  # the score rank 0 computes now
        self.done = 0  # rank 0's last score with an outcome
        self.last_failed = False  # ... and whether it failed
        self.notes: dict[int, dict[int, tuple[float, str]]] = {}  # score -> rank -> (when, error)

    def start(self) -> int:
        with self.changed:
            self.sent += 1
            self.running = self.sent
            return self.sent

    def succeeded(self, number: int) -> None:
        """A score rank 0 finished: every other rank must have finished it too."""
        with self.changed:
            self.running, self.done, self.last_failed = None, number, False
            noted = self.notes.get(number)
        if noted:
            rank, (_, error) = min(noted.items())
            _stop(self.children, f"tensor-parallel rank {rank} failed: {error}")

    def failed(self, number: int, error: str) -> None:
        """A score rank 0 failed: returns when every other rank noted a failure of it too
        (the input's, rank 0 raises it); otherwise stops the group with rank 0's error."""
        ranks = set(self.pipes)
        with self.changed:
            self.running = None  # settled here, not by the watchdog
            met = self.changed.wait_for(
                lambda: ranks <= set(self.notes.get(number, {})), timeout=self.skew
            )
            self.done, self.last_failed = number, True
            if met:
                del self.notes[number]  # settled: every rank goes on
        if not met:
            _stop(self.children, f"tensor-parallel rank 0 failed: {error}")

    def read_notes(self) -> None:
        """What the other ranks have noted since the last call."""
        ready, _, _ = select.select(list(self.pipes.values()), [], [], 0)
        for rank, pipe in self.pipes.items():
            if pipe not in ready:
                continue
            self.partial[rank] += os.read(pipe, 65536)
            *lines, self.partial[rank] = self.partial[rank].split(b"\n")
            with self.changed:
                for line in lines:
                    note = json.loads(line)
                    failures = self.notes.setdefault(note["score"], {})
                    failures[rank] = (time.monotonic(), note["error"])
                self.changed.notify_all()

    def failures_of(self, rank: int) -> list[str]:
        with self.changed:
            return [n[rank][1] for _, n in sorted(self.notes.items()) if rank in n]

    def alone(self) -> tuple[int, str] | None:
        """A rank whose failure rank 0 did not meet: rank 0 finished that score, or has not
        within `skew` seconds of the note (it waits in a collective for that rank). A
        failure rank 0 met too is its to settle (`failed`)."""
        with self.changed:
            for number, noted in sorted(self.notes.items()):
                rank, (when, error) = min(noted.items())
                if number == self.done and self.last_failed:
                    continue
                finished = number <= self.done
                stuck = self.running == number and time.monotonic() - when > self.skew
                if finished or stuck:
                    return rank, error
        return None


def _watch(ledger: _Ledger, closing: threading.Event) -> None:
    """A rank that died, or failed alone, leaves the others blocked in a collective forever
    (or computing on shards that no longer match): end this process too, saying which rank
    failed and why (a Ray replica is then restarted with fresh ranks)."""
    while not closing.wait(0.1):
        ledger.read_notes()
        for rank, child in enumerate(ledger.children, start=1):
            if child.poll() is not None and not closing.is_set():
                ledger.read_notes()
                noted = ledger.failures_of(rank)
                why = f"; it failed: {noted[-1]}" if noted else ""
                _stop(
                    ledger.children,
                    f"tensor-parallel rank {rank} (pid {child.pid}) exited with code "
                    f"{child.returncode}{why}",
                )
        if (alone := ledger.alone()) is not None:
            rank, error = alone
            _stop(ledger.children, f"tensor-parallel rank {rank} failed: {error}")


def _stop(children: list[subprocess.Popen], why: str) -> None:
    print(f"{why}; stopping the group", file=sys.stderr, flush=True)
    _kill_processes(children)
    os._exit(70)


def _abandon(children: list[subprocess.Popen], closing: threading.Event) -> None:
    closing.set()
    _kill_processes(children)


def _kill_processes(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def _stop_processes(children: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Wait for children told to stop; kill what is still running after `grace` seconds."""
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _build_cpu_all_reduce() -> None:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)


# -- ranks 1..N-1 -----------------------------------------------------------------------------
class Follower:
    """A rank other than 0: its own shards of rank 0's targets and copies of its contexts,
    kept identical by applying rank 0's commands in order."""

    def __init__(
        self, load: Callable[[ModelSpec], Any], note: Callable[[int, str], None] | None = None
    ):
        self.load = load
        self.note = note  # (score number, error): tells rank 0 of a failure
        self.targets: dict[int, Any] = {}
        self.contexts: dict[int, dict[int, Any]] = {}  # target -> context id -> context
        self.scores = 0  # mirrored scores so far, numbered as rank 0 numbers them
        self.failure: str | None = None  # how the last one failed here

    def apply(self, command: _Load | _Score) -> None:
        if isinstance(command, _Load):
            self.targets[command.target] = self.load(command.model)
            self.contexts[command.target] = {}
            return
        if self.failure is not None and not command.after_failure:
            # rank 0 did not fail the score this rank failed: their states differ
            raise RuntimeError(f"score {self.scores} failed here alone: {self.failure}")
        self.scores += 1
        self.failure = None
        target, held = self.targets[command.target], self.contexts[command.target]
        for ident, prompt, total_length in command.opened:
            held[ident] = target.open(prompt, total_length)
        for ident in command.released:
            held.pop(ident, None)
        try:
            target.score(
                [held[i] for i in command.contexts],
                command.windows,
                command.block_length,
                command.output_hidden,
            )
        except Exception as error:
            # rank 0 raises it if every rank met it, else stops the group (see the top)
            logger.exception("score failed on a follower rank")
            self.failure = f"{type(error).__name__}: {error}"
            if self.note is not None:
                self.note(self.scores, self.failure)


def serve(ranks: _Ranks, notes: int) -> None:
    """Follow rank 0's commands until it sends None: load targets, open and release
    contexts, run the same forwards (their results are rank 0's to use); a failure is noted
    on the pipe `notes` to rank 0."""
    group = ranks.group

    def note(score: int, error: str) -> None:
        line = json.dumps({"score": score, "error": error[:2000]}) + "\n"
        os.write(notes, line.encode())  # one write under PIPE_BUF bytes: whole or not at all

    follower = Follower(lambda model: load_shard(model, group.degree, group.device), note)
    while (command := ranks.broadcast(None)) is not None:
        follower.apply(command)


def _exit_with_parent(parent: int) -> None:
    """A rank outlives its replica only until it notices."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(argv: list[str]) -> None:
    group = GroupSpec(**json.loads(argv[0]))
    rank, notes = int(argv[1]), int(argv[2])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    ranks = _Ranks(group, rank)
    serve(ranks, notes)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # through the importable module, so the commands unpickle to the classes serve() checks
    from spot.models.tensor_parallel import _worker_main as main

    main(sys.argv[1:])
