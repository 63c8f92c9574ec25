"""The columnar ListObjectsV2 parser against ElementTree's (the parser before issue 42), on generated pages:
the same keys, sizes, ETags, prefixes and token, or the same error, for every page, well-formed or not."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote
from xml.sax.saxutils import escape

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blobdata._stores.s3.xml import _fast_page, parse_list_page, parse_list_page_tree

URL = "s3://bucket/pre/"
NS = ' xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
# Keys: ASCII with XML's and URLs' special characters, unicode (2-, 3-, 4-byte UTF-8), control characters
# (only URL-encoded ones can travel in XML).
KEY_CHARS = st.sampled_from([*list("ab/._-+% &<>\"'=;#:?*~\t\n\x01\x7féü€𝄞 "), "\u2028", "\ufeff"])


def _escape(text: str, style: str) -> str:
    if style == "minimal":
        return escape(text)
    if style == "all":
        return escape(text, {'"': "&quot;", "'": "&apos;"})
    return "".join(f"&#{ord(c)};" if c in "&<>" else c for c in text)  # character references


@st.composite
def pages(draw: Any) -> tuple[bytes, bool]:
    """(a ListObjectsV2 body, whether it is plain enough that the fast path must take it)."""
    encoded = draw(st.booleans())
    style = draw(st.sampled_from(["minimal", "all", "charref"]))
    pretty = draw(st.sampled_from(["", "\n", "\n  ", " \t"]))
    mixed = draw(st.booleans())  # entries of several shapes (as a bucket with and without checksums)
    extras = draw(st.booleans())
    keys = sorted(set(draw(st.lists(st.text(KEY_CHARS, min_size=0, max_size=12), max_size=12))))
    plain = style != "charref" and not pretty.count("\t")
    parts: list[str] = []
    if draw(st.booleans()):
        parts.append('<?xml version="1.0" encoding="UTF-8"?>' + pretty)
    parts.append(f"<ListBucketResult{NS if draw(st.booleans()) else ''}>")
    parts.append(f"<Name>bucket</Name><Prefix>pre/</Prefix><KeyCount>{len(keys)}</KeyCount>")
    if encoded:
        parts.append("<EncodingType>url</EncodingType>")
    for i, key in enumerate(keys):
        wire = quote(key, safe="/") if encoded else key
        if not encoded and any(c in key for c in "\x01\x7f\n\t"):
            plain = False if any(c in key for c in "\x01") else plain
        etag = draw(
            st.sampled_from(["&quot;{}&quot;", '"{}"', "{}", "&quot;&quot;{}&quot;", "&quot;{}&amp;x"])
        )
        if mixed:
            extras = draw(st.booleans())
        entry = [pretty, "<Contents>", pretty, f"<Key>{_escape(wire, style)}</Key>", pretty]
        if extras:
            entry.append("<LastModified>2026-01-01T00:00:00.000Z</LastModified>")
        entry += [f"<ETag>{etag.format(f'{i:032x}')}</ETag>", f"<Size>{draw(st.integers(0, 2**50))}</Size>"]
        if extras:
            entry.append(
                "<Owner><ID>o</ID><DisplayName></DisplayName></Owner><StorageClass>STANDARD</StorageClass>"
            )
        entry += [pretty, "</Contents>"]
        parts.append("".join(entry))
    for p in draw(st.lists(st.text(KEY_CHARS, min_size=1, max_size=6), max_size=3)):
        wire = quote(p + "/", safe="/") if encoded else p + "/"
        parts.append(f"<CommonPrefixes><Prefix>{_escape(wire, style)}</Prefix></CommonPrefixes>")
    truncated = draw(st.booleans())
    parts.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
    if truncated or draw(st.booleans()):
        parts.append(
            f"<NextContinuationToken>{_escape(draw(st.text(KEY_CHARS, min_size=1, max_size=8)), style)}"
            "</NextContinuationToken>"
        )
    parts.append("</ListBucketResult>" + pretty)
    text = "".join(parts)
    if any(c in text for c in "\x01\x7f"):  # raw control characters: invalid XML, the reference's error
        plain = False
    return text.encode("utf-8"), plain


@st.composite
def mutated(draw: Any) -> bytes:
    """A page with one thing wrong (or odd): cut, a byte changed, a part inserted or doubled."""
    body, _ = draw(pages())
    cut = draw(st.integers(0, max(0, len(body) - 1)))
    how = draw(st.sampled_from(["cut", "byte", "insert", "double"]))
    if how == "cut":
        return body[:cut]
    if how == "byte":
        return body[:cut] + bytes([draw(st.integers(0, 255))]) + body[cut + 1 :]
    piece = draw(
        st.sampled_from(
            [
                b"<",
                b">",
                b"</Key>",
                b"<Key>",
                b"<Size/>",
                b"<Contents/>",
                b"&",
                b"&bogus;",
                b"<!-- c -->",
                b"<![CDATA[x]]>",
                b"<a b='1'>",
                b"\r\n",
                b"\xff",
                b"</ListBucketResult>",
                b"<Key>x</Key>",
                b"<Size>-1</Size>",
                b"<ETag>e</ETag>",
                b"<x:Key>y</x:Key>",
                b"<IsTruncated>true</IsTruncated>",
                b"<?pi x?>",
                b"]]>",
                b"&#0;",
            ]
        )
    )
    if how == "double":
        return body[:cut] + body[cut : cut + 40] + body[cut:]
    return body[:cut] + piece + body[cut:]


def _outcome(parse: Any, body: bytes) -> Any:
    try:
        page = parse(body, URL)
    except Exception as exc:  # the two parsers must fail alike
        return type(exc), str(exc)
    return page.keys, page.sizes, page.etags, page.common_prefixes, page.next_token


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages())
def test_generated_pages_read_as_the_element_tree_reads_them(case: tuple[bytes, bool]) -> None:
    body, plain = case
    assert _outcome(parse_list_page, body) == _outcome(parse_list_page_tree, body)
    if plain:  # the fast path took it (it is not merely falling back every time)
        assert _fast_page(body) is not None, body


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
@example(b"<ListBucketResult><Contents><Key>k</Key></Contents></ListBucketResult>")
@example(b"<ListBucketResult><Contents><Key>k</Key><Size>1</Size></Contents><Contents/></ListBucketResult>")
@example(b"<ListBucketResult><Key>k</Kez></ListBucketResult>")
@example(
    b"<ListBucketResult><Contents><Key>k</Key><Size>01</Size><Size>2</Size></Contents></ListBucketResult>"
)
@example(b"<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>")
@example(b"<ListBucketResult><Contents><Key>k</Key><Size> 1</Size></Contents></ListBucketResult>")
@example(
    b"<ListBucketResult><Contents><Key>k</Key><Size>99999999999999999</Size></Contents></ListBucketResult>"
)
@example(b"<ListBucketResult><Contents><Key>a<b/>c</Key><Size>1</Size></Contents></ListBucketResult>")
@example(b"<ListBucketResult><Contents><Key>k</Key><Size>1</Size></Contents></ListBucketResult><x/>")
@example(  # a namespace holding "}": ElementTree refuses it, so the fast path must not take it
    b'<ListBucketResult xmlns="}ttp://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name>'
    b"<KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>"
)
@example(b'<ListBucketResult xmlns="a}b"><Contents><Key>k</Key><Size>1</Size></Contents></ListBucketResult>')
@example(b"<Error><Code>NoSuchBucket</Code></Error>")
@example(b"<ListBucketResult><Contents><Key>k</Kez><Size>1</Size></Contents></ListBucketResult>")
def test_broken_pages_fail_or_read_alike(body: bytes) -> None:
    assert _outcome(parse_list_page, body) == _outcome(parse_list_page_tree, body)


def _entries(count: int) -> list[str]:
    return [
        f"<Contents><Key>k{i:03d}</Key><LastModified>2026</LastModified><ChecksumAlgorithm>CRC64NVME"
        f"</ChecksumAlgorithm><Size>{i}</Size></Contents>"
        for i in range(count)
    ]


@pytest.mark.parametrize(
    "old, new",
    [
        ("</LastModified>", "</LastModifiex>"),
        ("</ChecksumAlgorithm>", "</ChecksumAlgorithmX>"),
        ("</ChecksumAlgorithm>", "</ChecksumAlgorithn>"),
        ("<Size>", "<Size/><Size>"),
        ("</Key>", "</Key></x>"),
    ],
)
@pytest.mark.parametrize("which", [0, 1, 5])
def test_an_entry_unlike_the_others_is_read_or_refused_as_the_element_tree_does(
    old: str, new: str, which: int
) -> None:
    """A run of equal entries with one changed past its name's first 8 bytes, or nested otherwise."""
    entries = _entries(6)
    entries[which] = entries[which].replace(old, new, 1)
    body = ("<ListBucketResult>" + "".join(entries) + "</ListBucketResult>").encode()
    assert _outcome(parse_list_page, body) == _outcome(parse_list_page_tree, body)
    plain = ("<ListBucketResult>" + "".join(_entries(6)) + "</ListBucketResult>").encode()
    assert _fast_page(plain) is not None


@pytest.mark.parametrize("count", [0, 1, 1000])
def test_the_synthetic_servers_pages_take_the_fast_path(count: int) -> None:
    from blobdata.testing import SyntheticListServer

    server = SyntheticListServer(count=max(count, 1))
    body = server._list({"prefix": "train/", "max-keys": str(max(count, 1)), "encoding-type": "url"})
    if count == 0:
        body = server._list({"prefix": "nothing/", "encoding-type": "url"})
    fast = _fast_page(body)
    assert fast is not None
    tree = parse_list_page_tree(body, URL)
    assert fast.objects == tree.objects and fast.next_token == tree.next_token
    assert len(fast.objects) == count


def test_the_synthetic_servers_entries_in_numpy_are_its_formula() -> None:
    """SyntheticListServer makes a plain root's entries with numpy: the keys, sizes and ETags its formula
    gives (the per-entry path is the reference), in every class."""
    from blobdata.testing import SyntheticListServer

    server = SyntheticListServer(count=30_000, classes=7)
    for start, end in ((0, 1000), (4_280, 4_300), (29_990, 30_000)):
        page = parse_list_page_tree(
            b"<ListBucketResult>" + server._entries(start, end) + b"</ListBucketResult>", URL
        )
        assert page.keys == [server.keys[i] for i in range(start, end)]
        assert page.sizes == [server.size(i) for i in range(start, end)]
        assert page.etags == [server.etag(i) for i in range(start, end)]
