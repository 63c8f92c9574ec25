import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blobdata import ConfigError
from blobdata._url import parse_url, safe_relpath


@pytest.mark.parametrize(
    "url,protocol,bucket,prefix",
    [
        ("s3://b/imagenet/train/", "s3", "b", "imagenet/train"),
        ("s3a://b", "s3", "b", ""),
        ("gs://b/x", "gs", "b", "x"),
        ("gcs://b/x", "gs", "b", "x"),
        ("az://cont/p q/+r", "az", "cont", "p q/+r"),
        ("abfs://cont@acct.dfs.core.windows.net/p", "az", "cont", "p"),
        ("memory://ds/a", "memory", "", "/ds/a"),
        ("file:///tmp/x/", "file", "", "/tmp/x"),
    ],
)
def test_parse_url(url: str, protocol: str, bucket: str, prefix: str) -> None:
    u = parse_url(url)
    assert (u.protocol, u.bucket, u.prefix) == (protocol, bucket, prefix)
    assert parse_url(str(u)) == u


def test_local_path_becomes_absolute(tmp_path: os.PathLike[str]) -> None:
    assert parse_url(tmp_path).prefix == os.path.abspath(tmp_path)


@pytest.mark.parametrize("bad", ["", "ftp://host/x", "s3://", "s3:///key", "s3://b/k?x=1"])
def test_bad_urls_name_themselves(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(bad)
    assert repr(bad) in str(info.value) or bad in str(info.value) or "URL" in str(info.value)


def test_child_keeps_keys_verbatim() -> None:
    root = parse_url("s3://b/root")
    for key in ["cls/ü ñ +.jpg", "cls/../x.jpg", "cls//x.jpg"]:
        assert str(root.child(key)) == "s3://b/root/" + key


@pytest.mark.parametrize(
    "key", ["../etc/passwd", "/abs", "a//b", "a/./b", "a/..", "", "a\\b", "a\x00b", "..", "a/"]
)
def test_safe_relpath_refuses_escapes(key: str) -> None:
    with pytest.raises(ConfigError):
        safe_relpath(key)


@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=8), max_size=5
    )
)
def test_safe_relpath_never_escapes(parts: list[str]) -> None:
    key = "/".join(parts)
    base = "/srv/cache"
    try:
        rel = safe_relpath(key)
    except ConfigError:
        return
    joined = os.path.normpath(os.path.join(base, rel))
    assert joined.startswith(base + os.sep)
