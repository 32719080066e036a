"""The input's identity: each row's digest, the recorded input, and the resume check that
refuses rows of another input (parts written here, without a model; the CLI runs are in
tests/test_output_safety.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline import identity
from pipeline.fingerprint import claim_output
from pipeline.identity import InputChanged, check_input, compare_written, row_digests
from pipeline.inputs import plan_input
from pipeline.job import parse_job
from pipeline.output import OutputDir, write_part
from tests.pipeline_fixtures import job_dict, output_rows, write_jsonl, write_prompts


def _blake(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def test_a_digest_is_blake2b_of_the_id_and_the_prompt():
    ids = pa.array(["a", None, "c"])
    prompts = pa.array(["hi", "hi", None])
    assert row_digests(ids, prompts).to_pylist() == [
        _blake("a\x1fhi"),
        _blake("\x00null\x1fhi"),
        _blake("c\x1f\x00null"),
    ]
    # ids are compared as text, as resume compares them; a chunked or sliced input agrees
    assert row_digests(pa.array([7]), pa.array(["x"])) == row_digests(
        pa.array(["7"]), pa.array(["x"])
    )
    chunked = pa.chunked_array([ids.slice(0, 1), ids.slice(1)])
    assert row_digests(chunked, prompts) == row_digests(ids, prompts)
    assert row_digests(ids.slice(1), prompts.slice(1)) == row_digests(ids, prompts).slice(1)
    dictionary = pa.array(["hi", "hi", "yo"]).dictionary_encode()
    assert row_digests(ids, dictionary) == row_digests(ids, pa.array(["hi", "hi", "yo"]))


def test_a_conversation_digest_covers_its_roles_and_contents_in_order():
    turn = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    chats = [
        [{"role": "user", "content": "hi", "name": "x"}],
        [{"role": "user", "content": "hi", "name": "y"}],  # other fields do not count
        [{"role": "system", "content": "hi", "name": None}],
        None,
    ]
    digests = row_digests(pa.array(["a"] * 4), pa.array(chats, pa.list_(turn))).to_pylist()
    assert digests[0] == digests[1] == _blake('a\x1f[["user", "hi"]]')
    assert len(set(digests[1:])) == 3


def _setup(root: Path, rows: dict[str, str], name: str = "prompts.jsonl", **sections):
    path = write_jsonl(root / name, [{"id": k, "prompt": v} for k, v in rows.items()])
    job = parse_job(job_dict(path, "builtin:sdar-nano", root / "out", **sections))
    return job, plan_input(job.input)


def _written(job, rows: dict[str, str], samples: int = 1) -> OutputDir:
    output = OutputDir(job.output.path)
    write_part(output, [output_rows(list(rows), list(rows.values()), samples=samples)])
    return output


def _refusal(output: OutputDir, job, plan) -> list[str]:
    with pytest.raises(InputChanged) as refused:
        check_input(output, plan, job.input)
    return refused.value.problems


ROWS = {f"q{i}": f"prompt {i}" for i in range(6)}


def test_unchanged_files_are_trusted_without_reading_a_row(tmp_path: Path, monkeypatch):
    job, plan = _setup(tmp_path, ROWS)
    claim_output(job, plan)
    _written(job, dict(list(ROWS.items())[:3]))

    def read(*args):
        raise AssertionError("the input's rows were read")

    monkeypatch.setattr(identity, "input_digests", read)
    assert check_input(OutputDir(job.output.path), plan, job.input) == []
    limited = parse_job(
        job_dict(plan.files[0], "builtin:sdar-nano", tmp_path / "out", input={"limit": 4})
    )
    assert check_input(OutputDir(job.output.path), plan_input(limited.input), limited.input) == []


def test_rows_written_are_matched_by_id_against_the_input(tmp_path: Path):
    job, plan = _setup(tmp_path, ROWS)
    claim_output(job, plan)
    output = _written(job, dict(list(ROWS.items())[:4]), samples=2)
    changed = {**ROWS, "q1": "another prompt", "q3": "and another"}
    other_job, other_plan = _setup(tmp_path, changed, name="changed.jsonl")
    comparison = compare_written(
        output, other_plan, identity.input_digests(other_plan, other_job.input)
    )
    assert (comparison.rows, comparison.changed, comparison.absent) == (8, 2, 0)
    assert comparison.first_changed == [(1, "q1"), (3, "q3")]  # (input row, id)
    assert comparison.first_unwritten == ["q4", "q5"]
    assert _refusal(output, other_job, other_plan) == [
        "input: 2 id(s) written have another prompt in the input now (first: 'q1', 'q3'); "
        "resuming would keep the old prompts' completions",
        "submit with --overwrite to delete those rows and start again, or set another output.path",
    ]


def test_another_input_is_refused_naming_ids_it_lacks(tmp_path: Path):
    job, plan = _setup(tmp_path, ROWS)
    claim_output(job, plan)
    output = _written(job, ROWS)
    other = {f"z{i}": f"prompt {i}" for i in range(6)}
    other_job, other_plan = _setup(tmp_path, {**other, "q5": "prompt 5"}, name="other.jsonl")
    assert _refusal(output, other_job, other_plan)[0] == (
        f"input: 5 id(s) written are not in the input (first: 'q0', 'q1', 'q2'): input.path "
        f"'{other_plan.files[0]}' is another input (the rows were made from {plan.files[0]})"
    )


def test_the_same_rows_elsewhere_resume_and_a_grown_input_needs_extend(tmp_path: Path):
    job, plan = _setup(tmp_path, ROWS)
    claim_output(job, plan)
    output = _written(job, ROWS)
    moved, moved_plan = _setup(tmp_path, dict(reversed(ROWS.items())), name="moved.jsonl")
    [note] = check_input(output, moved_plan, moved.input)  # rows reordered, same rows
    assert note == (
        f"input changed since this output's last submit (the rows were made from "
        f"{plan.files[0]}); the 6 row(s) written all match it"
    )
    grown = {**ROWS, "q6": "prompt 6", "q7": "prompt 7"}
    grown_job, grown_plan = _setup(tmp_path, grown)  # appended to the same file
    assert _refusal(output, grown_job, grown_plan) == [
        "input: holds 8 rows, 6 when this output was last submitted; the 6 row(s) written all "
        "match it; ids not generated yet: 'q6', 'q7', ...",
        "submit with --extend to generate the new rows too, or --overwrite to start again",
    ]
    assert check_input(output, grown_plan, grown_job.input, extend=True)
    claim_output(grown_job, grown_plan, extend=True)  # recorded: the next resubmit resumes
    assert check_input(output, grown_plan, grown_job.input) == []
    assert json.loads(Path(output.root, "input.json").read_text())["rows"] == 8


def test_a_rewritten_file_with_its_written_rows_unchanged_resumes(tmp_path: Path):
    job, plan = _setup(tmp_path, ROWS)
    claim_output(job, plan)
    output = _written(job, dict(list(ROWS.items())[:2]))
    os.utime(plan.files[0], ns=(0, 0))  # touched: the recorded time no longer matches
    [note] = check_input(output, plan_input(job.input), job.input)
    assert (
        note == "input changed since this output's last submit; the 2 row(s) written all match it"
    )


def test_rows_written_before_digests_are_counted_as_unchecked(tmp_path: Path):
    job, plan = _setup(tmp_path, ROWS)
    output = OutputDir(job.output.path)
    write_part(output, [output_rows(["q0", "q1"], ["x", "y"]).drop_columns(["input_digest"])])
    notes = check_input(output, plan, job.input)  # no input.json: the rows are compared
    assert notes[-1] == "2 row(s) written before input digests were kept: not checked"


def test_parquet_inputs_are_read_a_file_at_a_time_in_plan_order(tmp_path: Path):
    first = write_prompts(tmp_path / "in" / "a.parquet", {"id": [3, 1], "prompt": ["c", "a"]})
    write_prompts(tmp_path / "in" / "b.parquet", {"id": [2], "prompt": ["b"]})
    job = parse_job(job_dict(first.parent, "builtin:sdar-nano", tmp_path / "out"))
    plan = plan_input(job.input)
    digests = identity.input_digests(plan, job.input)
    assert digests == row_digests(plan.keys, pa.array(["c", "a", "b"]))


def test_rows_of_repeated_or_missing_ids_are_not_compared(tmp_path: Path):
    """Such rows are error rows, and their id names no one input row."""
    rows = [{"id": "a", "prompt": "x"}, {"id": "dup", "prompt": "1"}]
    rows += [{"id": "dup", "prompt": "2"}, {"prompt": "no id"}, {"prompt": "none either"}]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    job = parse_job(job_dict(path, "builtin:sdar-nano", tmp_path / "out"))
    plan = plan_input(job.input)
    output = OutputDir(job.output.path)
    ids = ["a", "dup", "dup", None, None]
    write_part(output, [output_rows(ids, [r["prompt"] for r in rows])])
    comparison = compare_written(output, plan, identity.input_digests(plan, job.input))
    assert (comparison.rows, comparison.changed, comparison.absent) == (5, 0, 0)
    write_part(output, [output_rows(["a"], ["y"], samples=2).slice(1)])  # a changed prompt
    comparison = compare_written(output, plan, identity.input_digests(plan, job.input))
    assert (comparison.changed, comparison.first_changed) == (1, [(0, "a")])
