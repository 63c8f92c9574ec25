"""The public surface is small and deliberate: this test fails when it changes by accident."""

import subprocess
import sys

import blobdata


def test_all_is_sorted_and_exact() -> None:
    assert blobdata.__all__ == sorted(blobdata.__all__)
    assert set(blobdata.__all__) == {
        "AccessDenied",
        "BlobCache",
        "BlobDataset",
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
        "MissingMember",
        "Mixture",
        "MixtureSampler",
        "NotFound",
        "ObjectChanged",
        "PartitionedSampler",
        "Peers",
        "Throttled",
        "WarmSummary",
        "__version__",
        "compare_runs",
        "list_folder",
        "sample_rng",
        "warm",
    }
    for name in blobdata.__all__:
        assert hasattr(blobdata, name), name


def test_nothing_else_leaks() -> None:
    """Everything public that ``import blobdata`` shows is in ``__all__`` (or a subpackage users import):
    no helper of the package's own (``TYPE_CHECKING`` once leaked this way)."""
    public = {n for n in vars(blobdata) if not n.startswith("_")}
    subpackages = {"gpu", "testing", "transforms"}
    assert public - subpackages == set(blobdata.__all__) - {"__version__"} - _LAZY, sorted(public)


_LAZY = {
    "BlobDataset", "BlobLoader", "ElasticDistributedSampler", "FolderDataset", "Mixture", "MixtureSampler",
    "PartitionedSampler",
}  # fmt: skip


def test_exports_say_blobdata_wherever_they_live() -> None:
    """Classes and functions of ``__all__`` name themselves ``blobdata.X`` in reprs and tracebacks, so
    a user never sees (or pickles by) a private module path; derived from ``vars()``, not a list."""
    for name in blobdata.__all__:
        obj = getattr(blobdata, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "blobdata", f"{name}: {obj.__module__}"
    assert repr(blobdata.FetchOptions).startswith("<class 'blobdata.FetchOptions'")
    assert "blobdata.NotFound" in repr(blobdata.NotFound)


def test_errors_pickle_by_their_public_name() -> None:
    import pickle

    err = blobdata.NotFound("s3://b/k: no such object", "s3://b/k")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is blobdata.NotFound and str(back) == str(err)


def test_subpackages_keep_their_public_names() -> None:
    import blobdata.gpu
    import blobdata.transforms

    assert set(blobdata.gpu.__all__) == {
        "IMAGENET_MEAN", "IMAGENET_STD", "TrainTransform", "check_device", "decode_batch", "decode_each",
    }  # fmt: skip
    assert set(blobdata.transforms.__all__) == {"DecodeAware", "RandomResizedCrop"}
    for module in (blobdata.gpu, blobdata.transforms):
        assert module.__all__ == sorted(module.__all__), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


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
        "folder_files",
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
