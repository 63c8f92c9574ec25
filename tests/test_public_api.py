"""The public surface is small and deliberate: this test fails when it changes by accident."""

import subprocess
import sys

import blobdata


def test_all_is_sorted_and_exact() -> None:
    assert blobdata.__all__ == sorted(blobdata.__all__)
    assert set(blobdata.__all__) == {
        "AccessDenied",
        "BlobCache",
        "BlobLoader",
        "BlobdataError",
        "CacheError",
        "CacheStats",
        "ConfigError",
        "DecodeError",
        "ElasticDistributedSampler",
        "EmptyDatasetError",
        "FetchError",
        "FetchOptions",
        "FetchTimeout",
        "FolderDataset",
        "LoaderStats",
        "Manifest",
        "ManifestError",
        "NotFound",
        "ObjectChanged",
        "PartitionedSampler",
        "Throttled",
        "WarmSummary",
        "__version__",
        "list_folder",
        "warm",
    }
    for name in blobdata.__all__:
        assert hasattr(blobdata, name), name


def test_public_names_have_docstrings() -> None:
    for name in blobdata.__all__:
        if name != "__version__":
            assert getattr(blobdata, name).__doc__, name


def test_testing_all_is_sorted_and_exact() -> None:
    import blobdata.testing

    assert blobdata.testing.__all__ == sorted(blobdata.testing.__all__)
    assert set(blobdata.testing.__all__) == {
        "FaultMode",
        "HOSTILE_MODES",
        "HostileMode",
        "HostileServer",
        "HttpProxy",
        "LatencyProxy",
        "LocalAzurite",
        "LocalGCSEmulator",
        "LocalS3Server",
        "S3Endpoint",
        "SyntheticListServer",
        "TrainTransform",
        "create_bucket",
        "find_free_port",
        "s3_client",
        "synthetic_dataset",
        "synthetic_jpeg",
        "upload",
    }
    for name in blobdata.testing.__all__:
        assert hasattr(blobdata.testing, name), name
        if name not in ("FaultMode", "HostileMode"):  # Literal aliases, documented where they are used
            assert getattr(blobdata.testing, name).__doc__, name


def test_importing_testing_starts_nothing_and_skips_torch() -> None:
    """In a fresh interpreter: no torch, no thread, no child process after ``import blobdata.testing``."""
    code = (
        "import sys, threading, psutil, blobdata.testing\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert psutil.Process().children() == []\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
