"""The stages that read a split hold a bounded part of it: their memory does not grow with it.

Two tests. The fast one measures the peak resident memory of a process running every such stage
on a generated split and on one ten times larger: holding the larger split whole would add its
decoded size. The heavy one runs each stage in its own process under a kernel memory limit (a
memory cgroup, v1 or v2, made here as root) smaller than the decoded split the stage reads, and
each must finish, while a process that loads that split whole under the same limit is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from streaming_stages import STAGES, decoded_bytes, generated_dataset, make_run

STAGE_RUNNER = Path(__file__).with_name("streaming_stages.py")
MiB = 1 << 20


def _run_stages(run_dir: Path, stages, preexec_fn=None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(STAGE_RUNNER), str(run_dir), *stages],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def _peak_rss(run_dir: Path) -> int:
    done = _run_stages(run_dir, STAGES)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])["peak_rss_bytes"]


def test_the_stages_hold_about_as_much_of_a_split_ten_times_larger(tmp_path):
    peaks, sizes = {}, {}
    for name, scale in (("small", 1), ("large", 10)):
        dataset = generated_dataset(
            tmp_path / name / "data", {"train": 256 * scale, "validation": 640 * scale, "test": 640 * scale}, 64
        )
        make_run(tmp_path / name / "run", dataset)
        peaks[name], sizes[name] = _peak_rss(tmp_path / name / "run"), decoded_bytes(dataset, "test")
    added_split = sizes["large"] - sizes["small"]  # 70.8 MiB of images more in each of the three splits
    # A stage holding the test or validation split whole would add at least added_split.
    assert peaks["large"] - peaks["small"] < 0.35 * added_split, (peaks, sizes)


@pytest.mark.heavy  # 200 s: the training split's variant of the test above, which make test runs
@pytest.mark.slow
def test_the_pruning_fine_tuning_holds_about_as_much_of_a_training_split_ten_times_larger(tmp_path):
    """Its 200 steps of 32 read the larger split once over: cached, it would hold all of it."""
    peaks, sizes = {}, {}
    for name, scale in (("small", 1), ("large", 10)):
        dataset = generated_dataset(tmp_path / name / "data", {"train": 640 * scale, "validation": 64, "test": 64}, 64)
        run_dir = tmp_path / name / "run"
        make_run(run_dir, dataset, prune=True, quantize="none", cache_budget_mb=0, shuffle_buffer=64, batch_size=32)
        done = _run_stages(run_dir, ["compress"])
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[name], sizes[name] = (
            json.loads(done.stdout.splitlines()[-1])["peak_rss_bytes"],
            decoded_bytes(dataset, "train"),
        )
    added_split = sizes["large"] - sizes["small"]  # 70.3 MiB of training images more
    assert peaks["large"] - peaks["small"] < 0.35 * added_split, (peaks, sizes)


def _memory_cgroup_v2(name: str) -> Path | None:
    root = Path("/sys/fs/cgroup")
    if "memory" not in (root / "cgroup.controllers").read_text().split():
        return None
    (root / "cgroup.subtree_control").write_text("+memory")
    group = root / name
    group.mkdir()
    return group


def _memory_cgroup_v1(name: str) -> Path:
    own = next(
        line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line
    )
    group = Path("/sys/fs/cgroup/memory" + own) / name
    group.mkdir()
    return group


@contextmanager
def memory_limit(limit: int):
    """A memory cgroup holding its processes to ``limit`` bytes, swap included; yields the function
    that moves a child process into it (``preexec_fn``), and the file of its peak usage. Skips the
    test where no cgroup can be made (not root, no writable memory controller)."""
    name = f"hetflow-test-{uuid.uuid4().hex[:8]}"
    try:
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            group = _memory_cgroup_v2(name)
            limits, peak = {"memory.max": limit, "memory.swap.max": 0}, "memory.peak"
        else:
            group = _memory_cgroup_v1(name)
            limits = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
            peak = "memory.max_usage_in_bytes"
        if group is None:
            raise PermissionError("no memory controller in cgroup v2")
    except (OSError, StopIteration) as error:
        pytest.skip(f"no memory cgroup can be made here ({error}): run as root where /sys/fs/cgroup is writable")
    try:
        for file, value in limits.items():
            if (group / file).exists():  # memsw and swap.max exist only with swap accounting
                (group / file).write_text(str(value))
        yield (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))), group / peak
    finally:
        group.rmdir()  # its processes have all ended: each was waited for


# What the whole-split code did: the test split as one array.
LOADS_WHOLE_SPLIT = """
from pathlib import Path

from hetflow.data.pipeline import split_arrays
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord

split_arrays(DatasetRecord.read(RunPaths(Path("{run_dir}"))), "test")
"""
# Above the stages' own peak (compress's, 1.35 GB at this image size with a few examples: TensorFlow
# and the TFLite converter), below the split.
LIMIT = 1600 * MiB
SIDE = 128  # 48 KiB per decoded image


@pytest.mark.heavy
def test_each_stage_finishes_under_a_memory_limit_smaller_than_the_split_it_reads(tmp_path):
    # Every split 1.69 GiB decoded: compress reads validation and the calibration sample of train,
    # the others the test split.
    count = 36_864
    dataset = generated_dataset(tmp_path / "data", {"train": count, "validation": count, "test": count}, SIDE)
    make_run(tmp_path / "run", dataset)
    assert decoded_bytes(dataset, "test") > LIMIT
    loads_whole = LOADS_WHOLE_SPLIT.format(run_dir=tmp_path / "run")
    with memory_limit(LIMIT) as (enter, peak_file):
        whole = subprocess.run([sys.executable, "-c", loads_whole], preexec_fn=enter, capture_output=True, timeout=600)
        assert whole.returncode == -9, whole.stderr[-2000:]  # the kernel's OOM kill: the limit bites
        for stage in STAGES:
            done = _run_stages(tmp_path / "run", [stage], preexec_fn=enter)
            assert done.returncode == 0, (stage, done.returncode, done.stderr[-3000:])
            peak = json.loads(done.stdout.splitlines()[-1])["peak_rss_bytes"]
            assert peak < LIMIT, (stage, peak)
        assert int(peak_file.read_text()) <= LIMIT
