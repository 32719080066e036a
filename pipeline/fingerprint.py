"""What decides a job's tokens, recorded beside its output, so that a resubmit never mixes
two configurations in one corpus.

`fingerprint(job)` maps job keys to the values that decide every completion: the model (its
path, a content identity of its checkpoint, family, dtype), every decoding setting, and how a
row becomes a prompt (id, prompt and messages columns, chat template, system prompt). The
first submit writes it as `fingerprint.json` beside summary.json; a submit into an output
that holds rows made under another fingerprint is refused before anything runs, naming each
key that differs, unless `--overwrite` empties the output first.

Left out, so they may change between runs: where the input is and how much of it is read
(`input.path`, `input.limit`), and everything that only changes speed (drafter, budget,
replicas, batch size, tensor parallel degree, GPUs and CPUs). Decoding is lossless: rows
written under one drafter and batch size are the rows another would write. The input's
identity, its rows themselves, is checked row by row instead (`pipeline.identity`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.identity import INPUT_FILE, InputRecord, check_input, write_record
from pipeline.inputs import InputPlan
from pipeline.job import Job, JobError, checkpoint_family
from pipeline.lease import check_lease
from pipeline.output import (
    DATA_DIR,
    DRAFTER_DIR,
    REPORT_DIR,
    RUNS_DIR,
    SUMMARY_FILE,
    OutputDir,
    write_atomically,
)
from spot.models.hub import CHECKPOINT_FILES

FINGERPRINT_FILE = "fingerprint.json"
INPUT_KEYS_FREE = ("path", "limit")  # where the rows are and how many: not how they decode
# None where the job was claimed (a hub id its replicas download): not compared then
UNKNOWABLE = ("model.checkpoint", "model.family")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
T = TypeVar("T")


class ResumeRefused(JobError):
    """The output holds rows made with another fingerprint."""


def fingerprint(job: Job) -> dict[str, Any]:
    """Every job key that decides the tokens, with its value (see the module docstring)."""
    model_dir = _local_checkpoint(job)
    family = job.model.family
    if family is None and model_dir is not None:
        family = checkpoint_family(model_dir)[1]
    keys: dict[str, Any] = {
        "model.path": job.model.path.portable,
        "model.checkpoint": None if model_dir is None else checkpoint_identity(model_dir),
        "model.family": family,
        "model.dtype": job.model.dtype,
    }
    for name, value in job.input.model_dump(mode="json").items():
        if name not in INPUT_KEYS_FREE:
            keys[f"input.{name}"] = value
    for name, value in job.model_dump(mode="json")["decoding"].items():
        keys[f"decoding.{name}"] = value
    return keys


def checkpoint_identity(model_dir: Path) -> str:
    """A short hash of the checkpoint's small files (configs, tokenizer, chat template) and of
    its weight files' names and sizes: cheap to take, and it changes when another checkpoint
    or tokenizer is put at the same path."""
    digest = hashlib.sha256()
    for file in sorted(model_dir.iterdir()):
        if not file.is_file() or not any(fnmatch.fnmatch(file.name, p) for p in CHECKPOINT_FILES):
            continue
        digest.update(file.name.encode() + b"\0")
        if file.suffix in WEIGHT_SUFFIXES:
            digest.update(str(file.stat().st_size).encode())
        else:
            digest.update(file.read_bytes())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every key whose value changed (keys one side lacks, and unknown
    checkpoint facts, are not compared)."""
    changed = []
    for key, new in current.items():
        if key not in recorded:
            continue
        old = recorded[key]
        if old == new or (key in UNKNOWABLE and None in (old, new)):
            continue
        changed.append(f"{key}: {_show(old)} -> {_show(new)}")
    return changed


def check_output(job: Job, plan: InputPlan) -> list[str]:
    """What `validate` asks, reading only: raises JobError where a submit would be refused
    (a live submit holds the output's lease; it holds rows of another fingerprint or
    another input); else the lines worth telling (`identity.check_input`, a lease a submit
    would take over)."""
    output = OutputDir(job.output.path)
    lease = _io(check_lease, output)
    _refuse_other_rows(output, fingerprint(job), _io(read_fingerprint, output))
    notes = _io(check_input, output, plan, job.input)
    return [*notes, *([lease] if lease else [])]


def claim_output(
    job: Job,
    plan: InputPlan,
    overwrite: bool = False,
    extend: bool = False,
    echo: Callable[[str], None] | None = None,
) -> OutputDir:
    """The job's output folder, checked and marked for this job before anything runs: with
    `overwrite`, emptied of its rows, summary and report (its logs stay); else refused
    (ResumeRefused) when it holds rows made with another fingerprint, or (InputChanged)
    from another input or, unless `extend`, from an input that grew since. Writes the job's
    fingerprint and its input's record (`identity.InputRecord`) where they changed; what
    is worth telling about the input goes to `echo`."""
    output = OutputDir(job.output.path)
    current = fingerprint(job)
    if overwrite:
        _io(clear_output, output)
    recorded = _io(read_fingerprint, output)
    _refuse_other_rows(output, current, recorded)
    for line in _io(check_input, output, plan, job.input, extend):
        if echo is not None:
            echo(f"[{job.name}] {line}")
    if recorded != current:
        text = json.dumps(current, indent=2).encode()
        _io(write_atomically, output.filesystem, _path(output), lambda f: f.write(text))
    _io(write_record, output, InputRecord.of(plan, job.input))
    return output


def _refuse_other_rows(
    output: OutputDir, current: dict[str, Any], recorded: dict[str, Any] | None
) -> None:
    if not _io(output.part_files):
        return
    changed = differences(recorded, current) if recorded else []
    if changed:
        raise ResumeRefused(
            [
                f"output.path: {output.uri} holds rows made with other settings "
                f"({FINGERPRINT_FILE}); resuming would mix them with this job's:",
                *(f"  {line}" for line in changed),
                "submit with --overwrite to delete those rows and start again, or set "
                "another output.path",
            ]
        )


def _io(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` on the output's file system; what it raises becomes a JobError."""
    try:
        return call(*args)
    except JobError:
        raise
    except (OSError, ValueError) as error:
        raise JobError([f"output.path: {error}"]) from error


def read_fingerprint(output: OutputDir) -> dict[str, Any] | None:
    path = _path(output)
    if output.filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with output.filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read().decode())


def clear_output(output: OutputDir) -> None:
    """Delete what a job wrote to `output` (rows, summary, report, learned drafters,
    fingerprint, the input's record and the markers of runs), not logs."""
    filesystem = output.filesystem
    names = (
        DATA_DIR,
        REPORT_DIR,
        DRAFTER_DIR,
        SUMMARY_FILE,
        FINGERPRINT_FILE,
        INPUT_FILE,
        RUNS_DIR,
    )
    for name in names:
        path = posixpath.join(output.root, name)
        kind = filesystem.get_file_info(path).type
        if kind == pafs.FileType.Directory:
            filesystem.delete_dir(path)
        elif kind == pafs.FileType.File:
            filesystem.delete_file(path)


def clearing_removes(job: Job) -> str | None:
    """What `claim_output(job, overwrite=True)` would delete, counted before it does ("3
    part files (64 rows), summary.json (2 runs), report/, fingerprint.json"); None when
    there is nothing. Rows are read from the parts' footers."""
    return _io(_contents, OutputDir(job.output.path))


def _contents(output: OutputDir) -> str | None:
    filesystem, found = output.filesystem, []
    parts = output.part_files()
    if parts:
        rows = 0
        for part in parts:
            with filesystem.open_input_file(part) as file:
                rows += pq.ParquetFile(file).metadata.num_rows
        found.append(f"{_count(len(parts), 'part file')} ({_count(rows, 'row')})")
    summary = output.read_summary()
    if summary is not None:
        found.append(f"{SUMMARY_FILE} ({_count(len(summary.get('runs', [])), 'run')})")
    report = filesystem.get_file_info(posixpath.join(output.root, REPORT_DIR))
    if report.type == pafs.FileType.Directory:
        found.append(f"{REPORT_DIR}/")
    learned = filesystem.get_file_info(posixpath.join(output.root, DRAFTER_DIR))
    if learned.type == pafs.FileType.Directory:
        found.append(f"{DRAFTER_DIR}/")
    if filesystem.get_file_info(_path(output)).type == pafs.FileType.File:
        found.append(FINGERPRINT_FILE)
    return ", ".join(found) or None


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _path(output: OutputDir) -> str:
    return posixpath.join(output.root, FINGERPRINT_FILE)


def _local_checkpoint(job: Job) -> Path | None:
    """The checkpoint directory on this machine (a hub id not cached, a URI: None)."""
    try:
        return job.model.path.cached_checkpoint()
    except (ImportError, OSError, ValueError):
        return None


def _show(value: Any) -> str:
    return json.dumps(value)
