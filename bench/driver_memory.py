"""The driver's peak memory against the size of the output it resumes into.

Fabricates an output folder of N rows in the project's output schema and part naming
(`pipeline.output.write_part`, parts of the size the runner cuts for such a job): ~300-character
prompts, ~1000-character completions and 256 token ids per row, one error row in a thousand.
The job's input holds exactly those ids and prompts, so `spot-pipeline submit` has nothing to
do. It is submitted twice: the first submit finds no record of the input (`input.json`), so
the driver reads the input's ids and prompts and checks every row written against them
(`pipeline.identity`: "checked"); the second finds the input's files as recorded and reads no
row ("resubmit"). Then a few new ids are added to the input and the same job is submitted
again (with --extend, where the checkout has it): its rows are checked again, and it generates
the new ones on an embedded Ray (sdar-nano, draft-free, 16 tokens) and writes the summary over
everything ("summary"). Each submit runs in a subprocess that reports its own
peak RSS (the driver process's VmHWM; Ray's processes are not counted).

    .venv/bin/python bench/driver_memory.py --rows 1000000 2000000
    .venv/bin/python bench/driver_memory.py --rows 1000000 2000000 --source /tmp/old-checkout

--source runs the driver from other checkouts (their pipeline/ and spot/ come first on the
path), in the same run and on the same data, so before/after rows compare directly. The
fabricated data (~1.3 GB per million rows, plus the input) are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.identity import row_digests  # noqa: E402
from pipeline.output import OutputDir, write_part  # noqa: E402
from pipeline.schema import BUDGET_ITERATIONS, GENERATED_FIELDS, INPUT_DIGEST  # noqa: E402

PROMPT_CHARS = 300
COMPLETION_CHARS = 1000
TOKENS_PER_ROW = 256
VOCABULARY = 32_000
ERROR_EVERY = 1000
NEW_ROWS = 32

# The driver, exactly as `spot-pipeline` runs it, reporting its own peak RSS when it exits
# (VmHWM: ru_maxrss would start from the RSS of the process that forked it).
_DRIVER = """\
import re, sys
from pipeline.cli import main
try:
    main(sys.argv[1:], prog_name="spot-pipeline")
finally:
    with open("/proc/self/status") as status:
        peak = re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1)
    print(f"driver peak RSS: {peak} KiB", file=sys.stderr, flush=True)
"""


@dataclass(frozen=True)
class DriverRun:
    """One `spot-pipeline` command in a subprocess."""

    returncode: int
    peak_rss_bytes: int  # the driver process's own high-water mark
    seconds: float
    output: str  # stdout and stderr
    stdout: str


def run_driver(
    args: list[str],
    source: Path = ROOT,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> DriverRun:
    """Run `spot-pipeline ARGS` from the checkout at `source` (`env` added to the
    environment, its PYTHONPATH first); its peak RSS and output."""
    env = {**os.environ, "PYTHONPATH": str(source), **(env or {})}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, *args],
        cwd=cwd or source,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    found = re.findall(r"driver peak RSS: (\d+) KiB", done.stderr)
    peak = int(found[-1]) * 1024 if found else 0
    return DriverRun(done.returncode, peak, seconds, output, done.stdout)


def word_text(rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` bytes of ASCII words (from the bundled prompts), as a uint8 array to slice."""
    lines = (ROOT / "spot/builtin/prompts/heldout.jsonl").read_text().splitlines()
    words = sorted({w for line in lines for w in json.loads(line)["prompt"].split() if w.isascii()})
    chosen = rng.choice(np.array(words, dtype=object), size // 4)
    return np.frombuffer(" ".join(chosen).encode()[:size], dtype=np.uint8)


def texts(rng: np.random.Generator, pool: np.ndarray, n: int, mean: int) -> pa.StringArray:
    """n strings of about `mean` characters, each a random slice of `pool`."""
    lengths = rng.integers(mean * 3 // 4, mean * 5 // 4 + 1, n)
    starts = rng.integers(0, len(pool) - lengths.max(), n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    data = pool[index]
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def fabricated_rows(
    rng: np.random.Generator, pool: np.ndarray, ids: list[str], prompts: pa.Array
) -> pa.Table:
    """Output rows in the engine's schema (`pipeline.engine._output_table`) for the input
    rows (`ids`, `prompts`), with their input digests."""
    n = len(ids)
    failed = np.zeros(n, dtype=bool)
    failed[rng.integers(0, n, max(1, n // ERROR_EVERY))] = True
    ok = ~failed
    tokens = rng.integers(0, VOCABULARY, n * TOKENS_PER_ROW)
    token_offsets = np.arange(0, (n + 1) * TOKENS_PER_ROW, TOKENS_PER_ROW, dtype=np.int32)
    nfe = rng.integers(20, 60, n)
    steps = nfe * rng.integers(1, 3, n)
    columns = {
        "completion": pc_where(ok, texts(rng, pool, n, COMPLETION_CHARS)),
        "completion_token_ids": pc_where(
            ok, pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(tokens))
        ),
        "num_prompt_tokens": pa.array(rng.integers(60, 100, n)),
        "num_generated_tokens": pc_where(ok, pa.array(np.full(n, TOKENS_PER_ROW))),
        "nfe": pc_where(ok, pa.array(nfe)),
        "steps": pc_where(ok, pa.array(steps)),
        "accepted_steps_per_forward": pc_where(ok, pa.array(steps / nfe)),
        "forward_share": pc_where(ok, pa.array(np.full(n, 1 / 8))),
        "tree_nodes_verified": pc_where(ok, pa.array(steps * 3)),
        "drafter_seconds": pc_where(ok, pa.array(rng.random(n) * 0.1)),
        "wall_seconds": pc_where(ok, pa.array(rng.random(n) * 2)),
        "finish_reason": pa.array(np.where(ok, "eos", "error")),
        "error": pa.array([None if good else "generation failed: RuntimeError" for good in ok]),
        "model": pa.array(["builtin:sdar-nano"] * n),
        "drafter": pa.array(["none"] * n),
        "seed": pa.array(np.zeros(n, dtype=np.int64)),
        "budget_iterations": pa.nulls(n, BUDGET_ITERATIONS),  # draft-free: no budget auto
    }
    arrays = [pa.array(ids), prompts]
    arrays += [columns[f.name].cast(f.type) for f in GENERATED_FIELDS]
    arrays.append(pa.array(np.zeros(n, dtype=np.int64)))
    names = ["id", "prompt", *(f.name for f in GENERATED_FIELDS), "sample_index"]
    arrays.append(row_digests(arrays[0], prompts))
    names.append(INPUT_DIGEST)
    return pa.Table.from_arrays(arrays, names=names)


def pc_where(ok: np.ndarray, values: pa.Array) -> pa.Array:
    """`values` with null where not `ok`."""
    import pyarrow.compute as pc

    return pc.if_else(pa.array(ok), values, pa.nulls(len(values), values.type))


def fabricate(work: Path, start: int, count: int, rows_per_part: int, seed: int) -> None:
    """Rows start..start+count: their output parts and an input file of their ids."""
    rng = np.random.default_rng(seed + start)
    pool = word_text(rng, 32 << 20)
    output = OutputDir(str(work / "out"))
    ids = [f"q{i:09d}" for i in range(start, start + count)]
    prompts = texts(rng, pool, count, PROMPT_CHARS)
    for first in range(0, count, rows_per_part):
        part = slice(first, first + rows_per_part)
        rows = fabricated_rows(rng, pool, ids[part], prompts[part])
        write_part(output, [rows])
    (work / "input").mkdir(exist_ok=True)
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), work / "input" / f"q{start}.parquet")


def write_job(work: Path) -> Path:
    job = {
        "name": "driver-memory",
        "input": {"path": str(work / "input"), "chat_template": True},
        "model": {"path": "builtin:sdar-nano", "family": "sdar", "dtype": "float32"},
        "drafter": {"kind": "none"},
        "decoding": {"gen_length": 16, "block_length": 16, "temperature": 0.0, "seed": 0},
        "resources": {"replicas": 1, "batch_size": 8, "num_cpus": 1},
        "output": {"path": str(work / "out")},
    }
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def new_rows(work: Path) -> Path:
    """NEW_ROWS short real prompts under new ids, as one more input file."""
    lines = (ROOT / "spot/builtin/prompts/heldout.jsonl").read_text().splitlines()[:NEW_ROWS]
    prompts = [json.loads(line)["prompt"] for line in lines]
    path = work / "input" / "new.parquet"
    pq.write_table(pa.table({"id": [f"new{i}" for i in range(NEW_ROWS)], "prompt": prompts}), path)
    return path


def check(run: DriverRun, pattern: str, what: str) -> None:
    if run.returncode != 0 or not re.search(pattern, run.output):
        sys.exit(f"{what} failed (exit {run.returncode}):\n{run.output[-4000:]}")


def probe(work: Path, job: Path, rows: int, source: Path) -> dict[str, DriverRun]:
    """Two resubmits with nothing to do (the first checks the rows written against the
    input), then a run that generates NEW_ROWS, from `source`."""
    output = OutputDir(str(work / "out"))
    fabricated = set(output.part_files())
    checked = run_driver(["submit", str(job)], source, cwd=work)
    check(checked, rf"{rows} already written, 0 to generate", "first resubmit")
    resubmit = run_driver(["submit", str(job)], source, cwd=work)
    check(resubmit, rf"{rows} already written, 0 to generate", "resubmit")
    added = new_rows(work)
    extend = ["--extend"] if "--extend" in (source / "pipeline" / "cli.py").read_text() else []
    generate = run_driver(["submit", str(job), *extend], source, cwd=work)
    check(generate, rf"{rows} already written, {NEW_ROWS} to generate", "generating run")
    summary = output.read_summary()
    assert summary["totals"]["rows"] == rows + NEW_ROWS, summary["totals"]
    assert summary["runs"][-1]["rows_written"] == NEW_ROWS, summary["runs"][-1]
    for path in set(output.part_files()) - fabricated:  # back to the fabricated rows
        os.remove(path)
    added.unlink()
    for name in ("summary.json", "input.json"):
        Path(output.root, name).unlink(missing_ok=True)
    return {"checked": checked, "resubmit": resubmit, "summary": generate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 2_000_000])
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        help="a checkout to run the driver from (repeatable; default: this one)",
    )
    parser.add_argument(
        "--rows-per-part",
        type=int,
        default=None,
        help="rows per part file (default: the runner's block size for this job)",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the fabricated data")
    args = parser.parse_args()
    sources = [s.resolve() for s in args.source or [ROOT]]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="driver-memory-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    job = write_job(work)
    results = []
    try:
        written = 0
        for rows in sorted(args.rows):
            per_part = args.rows_per_part or _rows_per_part(job, rows)
            start = time.perf_counter()
            fabricate(work, written, rows - written, per_part, seed=0)
            written = rows
            size = sum(f.stat().st_size for f in (work / "out" / "data").iterdir())
            print(
                f"{rows:,} rows fabricated ({per_part} per part, "
                f"{size / 1e9:.2f} GB of Parquet) in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            for source in sources:
                for scenario, run in probe(work, job, rows, source).items():
                    results.append((rows, source, scenario, run))
                    print(
                        f"  {source}: {scenario:<8} peak RSS {run.peak_rss_bytes / 2**20:,.0f} "
                        f"MiB, {run.seconds:.1f} s",
                        flush=True,
                    )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)


def _rows_per_part(job_file: Path, rows: int) -> int:
    from pipeline.job import parse_job
    from pipeline.stages import rows_per_block

    return rows_per_block(rows, parse_job(yaml.safe_load(job_file.read_text())))


def print_table(results: list[tuple[int, Path, str, DriverRun]]) -> None:
    """Peak RSS per size, and its growth per row between the smallest and largest size."""
    print(f"\n{'rows':>10}  {'scenario':<8}  {'peak MiB':>9}  {'seconds':>8}  source")
    for rows, source, scenario, run in results:
        print(
            f"{rows:>10,}  {scenario:<8}  {run.peak_rss_bytes / 2**20:>9,.0f}  "
            f"{run.seconds:>8.1f}  {source}"
        )
    keys = sorted({(source, scenario) for _, source, scenario, _ in results})
    for source, scenario in keys:
        runs = sorted((r, run) for r, s, c, run in results if (s, c) == (source, scenario))
        if len(runs) < 2:
            continue
        (small, a), (large, b) = runs[0], runs[-1]
        per_row = (b.peak_rss_bytes - a.peak_rss_bytes) / (large - small)
        print(
            f"{scenario} from {source}: {large:,} rows cost "
            f"{b.peak_rss_bytes / a.peak_rss_bytes:.2f}x the memory of {small:,}; "
            f"{per_row:,.0f} bytes per row"
        )


if __name__ == "__main__":
    main()
