import pickle

import pytest

import blobdata
from blobdata import _errors

ALL = [getattr(_errors, n) for n in _errors.__all__]

BUILTIN = {
    "ConfigError": ValueError,
    "NotFound": FileNotFoundError,
    "EmptyDatasetError": FileNotFoundError,
    "AccessDenied": PermissionError,
    "FetchError": OSError,
    "Throttled": OSError,
    "FetchTimeout": TimeoutError,
    "ObjectChanged": OSError,
    "DecodeError": ValueError,
    "ManifestError": ValueError,
    "CacheError": OSError,
}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_pickles_with_message_and_url(cls: type[blobdata.BlobdataError]) -> None:
    err = cls("cannot read s3://bucket/a b+c.jpg: reason", url="s3://bucket/a b+c.jpg")
    err.attempts = 3  # extra state survives too
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.url == "s3://bucket/a b+c.jpg"
    assert back.attempts == 3
    assert isinstance(back, blobdata.BlobdataError)


@pytest.mark.parametrize("name,builtin", sorted(BUILTIN.items()))
def test_errors_inherit_the_builtin_a_user_would_catch(name: str, builtin: type[Exception]) -> None:
    cls = getattr(blobdata, name)
    assert issubclass(cls, builtin)
    with pytest.raises(builtin):
        raise cls("x", url="s3://b/k")


def test_hierarchy_is_documented() -> None:
    doc = _errors.__doc__ or ""
    for name in _errors.__all__:
        assert name in doc, name
