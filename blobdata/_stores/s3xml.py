"""The wire format of an S3 ListObjectsV2 request and its response, parsed with ``xml.etree``.

~0.03 s of client CPU per 1,000-key page, where botocore's parser spends ~0.14 s. Requests ask for
``encoding-type=url`` so keys with control characters survive XML, and keys are decoded as botocore
decodes them; a server that ignores the parameter is read verbatim.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import NamedTuple
from urllib.parse import quote, unquote_plus

from .._errors import FetchError
from .base import listed_size

__all__ = ["ListPage", "list_query", "parse_list_page"]


class ListPage(NamedTuple):
    """One ListObjectsV2 page: parallel lists of ``keys`` (decoded, exactly as stored), ``sizes``
    (bytes) and ``etags`` (quotes stripped), the ``common_prefixes`` (with their trailing delimiter)
    and ``next_token``, the continuation token of the next page (``None`` on the last page)."""

    keys: list[str]
    sizes: list[int]
    etags: list[str]
    common_prefixes: list[str]
    next_token: str | None


def _query_quote(value: str) -> str:
    # SigV4's URI encoding: every byte but A-Za-z0-9-_.~ as %XX (upper case), '/' included.
    return quote(value, safe="")


def list_query(prefix: str, *, delimiter: str | None, continuation: str | None, max_keys: int = 1000) -> str:
    """The query string of one ListObjectsV2 request (``encoding-type=url``), already canonical for
    SigV4: parameters sorted by name, names and values percent-encoded. It is sent exactly as signed.

    An empty ``prefix`` or ``delimiter`` is left out (the store treats both alike).
    """
    params = [("encoding-type", "url"), ("list-type", "2"), ("max-keys", str(max_keys))]
    if continuation is not None:
        params.append(("continuation-token", continuation))
    if delimiter:
        params.append(("delimiter", delimiter))
    if prefix:
        params.append(("prefix", prefix))
    return "&".join(f"{_query_quote(k)}={_query_quote(v)}" for k, v in sorted(params))


def _malformed(url: str, what: str) -> FetchError:
    return FetchError(
        f"{url}: the store sent a listing page that cannot be read ({what}); check endpoint_url points "
        "at an S3 API",
        url,
    )


def parse_list_page(body: bytes, url: str) -> ListPage:
    """Parse a ListObjectsV2 response body (``xml.etree``, any or no XML namespace).

    Keys and prefixes are URL-decoded as botocore decodes them (``unquote_plus``) when the response
    says ``<EncodingType>url</EncodingType>``, and taken verbatim when the server ignored the
    request for it. Raises :class:`FetchError` naming ``url`` for anything that is not a listing,
    and :class:`~blobdata._errors.ManifestError` naming the object for a size that is not a whole
    number of bytes from 0 to :data:`~.base.MAX_LISTED_SIZE`.
    """
    # ElementTree never fetches external entities, and expat >= 2.4 caps entity expansion.
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise _malformed(url, f"invalid XML: {exc}") from None
    tag = root.tag
    ns = tag[: tag.index("}") + 1] if tag.startswith("{") else ""
    if tag[len(ns) :] != "ListBucketResult":
        raise _malformed(url, f"root element {tag[len(ns) :]!r}")
    t_contents, t_common, t_key, t_size, t_etag, t_prefix = (
        ns + n for n in ("Contents", "CommonPrefixes", "Key", "Size", "ETag", "Prefix")
    )
    t_encoding, t_truncated, t_next = (
        ns + n for n in ("EncodingType", "IsTruncated", "NextContinuationToken")
    )
    keys: list[str] = []
    raw_sizes: list[str] = []
    etags: list[str] = []
    prefixes: list[str] = []
    encoded = truncated = False
    token: str | None = None
    for el in root:
        t = el.tag
        if t == t_contents:
            key = size = None
            etag = ""
            for field in el:
                ft = field.tag
                if ft == t_key:
                    key = field.text or ""
                elif ft == t_size:
                    size = field.text
                elif ft == t_etag:
                    etag = (field.text or "").strip('"')
            if key is None or size is None:
                raise _malformed(url, "an entry without Key or Size")
            raw_sizes.append(size)
            keys.append(key)
            etags.append(etag)
        elif t == t_common:
            prefixes.extend(field.text or "" for field in el if field.tag == t_prefix)
        elif t == t_encoding:
            encoded = (el.text or "").strip().lower() == "url"
        elif t == t_truncated:
            truncated = (el.text or "").strip().lower() == "true"
        elif t == t_next:
            token = el.text or None
    if encoded:
        keys = [unquote_plus(k) if "%" in k or "+" in k else k for k in keys]
        prefixes = [unquote_plus(p) if "%" in p or "+" in p else p for p in prefixes]
    bucket_url = "/".join(url.split("/", 3)[:3])  # s3://bucket
    sizes = [listed_size(size, f"{bucket_url}/{key}") for key, size in zip(keys, raw_sizes, strict=True)]
    if not truncated:
        token = None
    elif token is None:
        raise _malformed(url, "IsTruncated without a NextContinuationToken")
    return ListPage(keys, sizes, etags, prefixes, token)
