"""A recording in shards reads as one recording: the same requests recorded in any batches and
shards load as the same tensors (canonical order: request key, then step), and shards that
cannot belong to one recording are refused. The recording job itself (replicas of a job's
target writing the shards) runs on a two-node cluster in tests/test_cluster.py."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from spot.config import DecodingConfig
from spot.drafters.recipes import record_trajectories
from spot.drafters.trajectory import _FIELDS, Trajectories
from tests.test_spot_drafter import requests
from tests.toy import ToyTarget

CONFIG = DecodingConfig(gen_length=16, block_length=8, temperature=0.7, seed=2)


def _same(a: Trajectories, b: Trajectories) -> None:
    for name in _FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.hidden, b.hidden)
    assert a.meta == b.meta


def test_shards_load_as_the_whole_recording(tmp_path):
    target = ToyTarget(seed=3, sharpness=4.0)
    reqs = requests(10, seed=5)
    whole = record_trajectories(target, reqs, CONFIG, batch_size=10, hidden=True)
    folder = tmp_path / "shards"
    record_trajectories(target, reqs[:3], CONFIG, 2, True).save(folder / "shard-a.pt")
    record_trajectories(target, reqs[3:], CONFIG, 4, True).save(folder / "shard-b.pt")
    (folder / ".shard-c.pt.partial").write_bytes(b"a write that was killed")

    loaded = Trajectories.load(folder)
    _same(loaded, whole.canonical())
    assert loaded.meta["requests"] == 10
    # segments stay consecutive runs of one block of one request, in step order
    starts = torch.ones_like(loaded.segment, dtype=torch.bool)
    starts[1:] = loaded.segment[1:] != loaded.segment[:-1]
    assert torch.equal(loaded.segment, torch.cumsum(starts, 0).to(torch.int32) - 1)
    assert bool((loaded.block_step[~starts] == loaded.block_step.roll(1)[~starts] + 1).all())

    record_trajectories(target, reqs[2:3], CONFIG, 2, True).save(folder / "shard-c.pt")
    with pytest.raises(ValueError, match="is recorded in shard-a.pt and shard-c.pt"):
        Trajectories.load(folder)
    hotter = DecodingConfig(gen_length=16, block_length=8, temperature=0.9, seed=2)
    record_trajectories(target, reqs[3:4], hotter, 2, True).save(folder / "shard-c.pt")
    with pytest.raises(ValueError, match="shard-c.pt was recorded with another temperature"):
        Trajectories.load(folder)
    with pytest.raises(ValueError, match="holds no trajectory shards"):
        Trajectories.load(tmp_path)


def test_calibrate_spiffy_reads_a_shard_folder(tmp_path):
    target = ToyTarget(seed=3, sharpness=4.0)
    reqs = requests(6, seed=5)
    folder = tmp_path / "shards"
    for i in range(0, 6, 2):
        record_trajectories(target, reqs[i : i + 2], CONFIG, 2).save(folder / f"shard-{i}.pt")
    out = tmp_path / "graph.json"
    args = ["calibrate-spiffy", "--trajectories", str(folder), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--budget", "4"])
    assert result.exit_code == 0, result.output
    assert out.is_file()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--out", "x"], "give a JOB_FILE (recorded by its replicas) or --model"),
        (["--model", "builtin:sdar-nano", "--address", "http://h:8265", "--out", "x"], "JOB_FILE"),
        (["job.yaml", "--gen-length", "32", "--prompts", "9", "--out", "x"], "--prompts, --gen"),
    ],
)
def test_record_trajectories_takes_a_job_file_or_a_model(args, message):
    result = CliRunner().invoke(main, ["record-trajectories", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_folder_knows_the_rows_it_holds(tmp_path):
    """Recording again into a folder skips the (row, sample) pairs its shards hold."""
    import pyarrow as pa

    from pipeline.recording import RecordingFolder, _done_rows
    from spot.decode import Request
    from spot.noise import request_key

    target = ToyTarget(seed=3, sharpness=4.0)
    prompt = torch.tensor([1, 2, 3])
    held = [Request(prompt, request_key("a", 1)), Request(prompt, request_key("b", 0))]
    folder = RecordingFolder(str(tmp_path))
    folder.write("shard-x.pt", record_trajectories(target, held, CONFIG, 2).to_bytes())
    (tmp_path / ".shard-y.pt.partial").write_bytes(b"killed")
    folder.remove_partial_files()
    assert [p.name for p in tmp_path.iterdir()] == ["shard-x.pt"]
    done = _done_rows(pa.array(["a", "b", "c"]), 2, folder.recorded_keys())
    assert sorted(done.to_pylist()) == ["a\x1f1", "b\x1f0"]


def test_recording_a_job_again_finds_nothing_to_do_and_reads_no_drafter(tmp_path):
    """A job whose rows its folder already holds records nothing (and starts no Ray); the
    job's drafter, perhaps the one to be trained on this recording, need not exist."""
    import yaml

    from spot.decode import Request
    from spot.noise import request_key
    from tests.pipeline_fixtures import job_dict, write_prompts

    prompts = write_prompts(tmp_path / "p.parquet", {"id": ["a", "b"], "prompt": ["x", "y"]})
    job = job_dict(prompts, "builtin:sdar-nano", tmp_path / "unused")
    job["drafter"] = {"kind": "spot", "path": str(tmp_path / "not-trained-yet.safetensors")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    keys = [request_key("a"), request_key("b")]
    held = [Request(torch.tensor([1, 2, 3]), key) for key in keys]
    target = ToyTarget(seed=3, sharpness=4.0)
    record_trajectories(target, held, CONFIG, 2).save(tmp_path / "shards" / "shard-x.pt")
    args = ["record-trajectories", str(tmp_path / "job.yaml"), "--out", str(tmp_path / "shards")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 already recorded, 0 to record" in result.output


def test_a_folder_without_shards_or_with_clashing_ones_is_a_bad_trajectories_option(tmp_path):
    target = ToyTarget(seed=3, sharpness=4.0)
    args = ["calibrate-spiffy", "--trajectories", str(tmp_path), "--out", str(tmp_path / "g")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Invalid value for --trajectories" in result.output
    assert "holds no trajectory shards (shard-*.pt)" in result.output
    reqs = requests(2, seed=5)
    record_trajectories(target, reqs, CONFIG, 2).save(tmp_path / "shard-a.pt")
    record_trajectories(target, reqs[1:], CONFIG, 2).save(tmp_path / "shard-b.pt")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "is recorded in shard-a.pt and shard-b.pt" in result.output
