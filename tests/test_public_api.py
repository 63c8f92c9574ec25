"""The public surface is small and deliberate: this test fails when it changes by accident."""

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
        "Throttled",
        "__version__",
    }
    for name in blobdata.__all__:
        assert hasattr(blobdata, name), name


def test_public_names_have_docstrings() -> None:
    for name in blobdata.__all__:
        if name != "__version__":
            assert getattr(blobdata, name).__doc__, name
