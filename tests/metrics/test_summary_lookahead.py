"""``stats().summary()`` says why more objects were read than samples served (issue 30)."""

from __future__ import annotations

from blobdata import LoaderStats


def _stats(**kw: float) -> LoaderStats:
    base = {"samples": 96, "batches": 3, "loop_batches": 3, "elapsed_s": 0.7, "loop_wait_s": 0.7,
            "wait_fraction": 1.0, "samples_per_s": 137.0, "fetch_wait_s_per_sample": 0.009,
            "decode_s_per_sample": 0.004}  # fmt: skip
    return LoaderStats(**{**base, **kw})  # type: ignore[arg-type]


def test_summary_says_what_the_look_ahead_read_for_batches_to_come() -> None:
    line = _stats(samples_from_bucket=350, batches=5).summary()
    assert line.startswith("96 samples served in 0.7s (137 img/s)"), line
    assert line.endswith(
        "; look-ahead: 350 objects read, 254 of them ahead for batches to come, "
        "2 batches made and waiting for the loop"
    ), line


def test_summary_says_nothing_of_the_look_ahead_when_reads_match_samples() -> None:
    line = _stats(samples_from_bucket=60, samples_from_cache=36).summary()
    assert "look-ahead" not in line and "96 samples served" in line
