"""The wire format of an S3 ListObjectsV2 request and its response, parsed straight into columns.

Requests ask for ``encoding-type=url`` so keys with control characters survive XML, and keys are
decoded as botocore decodes them; a server that ignores the parameter is read verbatim.

A page (1,000 entries, ~100 KiB) is read from its bytes with a few dozen numpy passes, not an element
tree: every markup is found (each ``<`` to the ``>`` after it), its name read as three 8-byte words,
the nesting proved by depth (each open tag's close is the next tag at its depth, with its name), and
the texts of ``Contents/Key``, ``Size`` and ``ETag`` gathered into :class:`~.columns.Columns` arrays
(:func:`_fast_page`). That fast path takes only what it can prove well-formed and equal to what
``xml.etree`` reads: UTF-8 without control characters, names of ASCII name characters, no attribute
but the root's ``xmlns``, no comment, CDATA, DOCTYPE or character reference, entities only the five
XML predefines. Anything else (and every page it would refuse) goes to the ElementTree parser, which
gives the same result or the error; tests/stores/test_s3xml_columns.py checks that the two agree on
generated pages.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any, NamedTuple
from urllib.parse import quote, unquote_plus

import numpy as np

from ..._errors import FetchError
from ..base import MAX_LISTED_SIZE, Columns, gather, join_bytes, listed_size

__all__ = ["ListPage", "list_query", "parse_list_page", "parse_list_page_tree"]


class ListPage(NamedTuple):
    """One listing page: ``objects`` (keys decoded, exactly as stored; sizes in bytes; identities, ETags
    without quotes), the ``common_prefixes`` (with their trailing delimiter) and ``next_token``, the
    continuation token of the next page (``None`` on the last page). ``ordered``: the listing checked
    that its keys so far, this page's included, increase by their bytes (S3's order)."""

    objects: Columns
    common_prefixes: list[str]
    next_token: str | None
    ordered: bool = False

    @property
    def keys(self) -> list[str]:
        return self.objects.key_list()

    @property
    def sizes(self) -> list[int]:
        return [int(s) for s in self.objects.sizes]

    @property
    def etags(self) -> list[str]:
        return self.objects.id_list()


_ASCII_QUOTE = {c: f"%{c:02X}" for c in range(128) if not (chr(c).isalnum() or chr(c) in "-_.~")}


def _query_quote(value: str) -> str:
    # SigV4's URI encoding: every byte but A-Za-z0-9-_.~ as %XX (upper case), '/' included.
    if value.isascii():
        return value.translate(_ASCII_QUOTE)  # the same, without a call per character
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
    """Parse a ListObjectsV2 response body (any or no XML namespace) into columns.

    Keys and prefixes are URL-decoded as botocore decodes them (``unquote_plus``) when the response
    says ``<EncodingType>url</EncodingType>``, and taken verbatim when the server ignored the
    request for it. Raises :class:`FetchError` naming ``url`` for anything that is not a listing,
    and :class:`~blobdata._errors.ManifestError` naming the object for a size that is not a whole
    number of bytes from 0 to :data:`~.base.MAX_LISTED_SIZE`.
    """
    page = _fast_page(body)
    if page is None:
        return parse_list_page_tree(body, url)
    return page


def parse_list_page_tree(body: bytes, url: str) -> ListPage:
    """:func:`parse_list_page` by ``xml.etree``: for the pages the fast path does not take, and the
    reference the fast path is tested against."""
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
    kb, ko = join_bytes([k.encode("utf-8", "surrogatepass") for k in keys])
    ib, io = join_bytes([e.encode("utf-8", "surrogatepass") for e in etags])
    return ListPage(Columns(kb, ko, np.array(sizes, dtype=np.int64), ib, io), prefixes, token)


# -- the fast path -------------------------------------------------------------------------------

_DECL = re.compile(
    rb"""<\?xml\s+version\s*=\s*(?:"1\.[0-9]+"|'1\.[0-9]+')"""
    rb"""(?:\s+encoding\s*=\s*(?:"[Uu][Tt][Ff]-8"|'[Uu][Tt][Ff]-8'))?"""
    rb"""(?:\s+standalone\s*=\s*(?:"(?:yes|no)"|'(?:yes|no)'))?\s*\?>"""
)
# A namespace holding "}" is left to ElementTree, which refuses it ("{uri}name" could not be split).
_ROOT = re.compile(rb"""<ListBucketResult(?:\s+xmlns\s*=\s*(?:"[^"<&}]*"|'[^'<&}]*'))?\s*>""")
_CLOSE_ROOT = b"</ListBucketResult>"
_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_.-]*")
_ENTITY = re.compile(rb"&(?:amp|lt|gt|quot|apos);")
_WS = b" \t\n"
_MASKS = np.array([(1 << (8 * r)) - 1 for r in range(8)] + [(1 << 64) - 1], dtype=np.uint64)
_CONTENTS = int.from_bytes(b"Contents", "little")
_TEXTS = {b"Key", b"Size", b"ETag", b"Prefix", b"EncodingType", b"IsTruncated", b"NextContinuationToken"}
_POW10 = 10 ** np.arange(16, dtype=np.int64)


def _unescape(raw: bytes) -> str:
    """An XML text with the five predefined entities (the only ones the fast path lets through)."""
    text = raw.decode("utf-8")
    if "&" in text:
        for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&")):
            text = text.replace(entity, char)
    return text


def _at6(body: bytes, where: Any) -> Any:
    """The 6 bytes of ``body`` at each of ``where`` (as numpy ``S6``; short near the end)."""
    if len(body) < 6:
        return np.zeros(len(where), dtype="S6")
    view = np.ndarray((len(body) - 5,), dtype="S6", buffer=body, strides=(1,))
    return view[np.minimum(where, len(body) - 6)]


def _clean(body: bytes, a: Any) -> bool:
    """Whether the bytes hold nothing the fast path leaves to expat: invalid UTF-8, a character XML
    forbids (or \\r, which a parser turns into \\n), a reference but the five predefined entities."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return False
        if b"\xef\xbf\xbe" in body or b"\xef\xbf\xbf" in body:  # U+FFFE, U+FFFF: not XML characters
            return False
    low = a[a < 32]
    if (len(low) and bool(((low != 9) & (low != 10)).any())) or b"]]>" in body:  # "]]>" may not be text
        return False
    amp = np.flatnonzero(a == 38)
    if not len(amp) or bool((_at6(body, amp) == b"&quot;").all()):
        return True
    return len(_ENTITY.findall(body)) == len(amp)


class _Markup(NamedTuple):
    """The markups inside the root: where each begins (``s``), ends (``e``, its '>'), the next begins
    (``nxt``); whether it closes an element or is one (``<x/>``); its name's start, length and words."""

    s: Any
    e: Any
    nxt: Any
    closing: Any
    empty: Any
    name_at: Any
    length: Any
    words: Any  # (3, m) uint64: the name's bytes 0-7, 8-15, 16-23, zero past its end


def _markup(body: bytes, a: Any) -> _Markup | None:
    lt = np.flatnonzero(a == 60)
    gt = np.flatnonzero(a == 62)
    if len(lt) < 2 or not len(gt):
        return None
    if len(lt) == len(gt) and bool((gt > lt).all()) and bool((gt[:-1] < lt[1:]).all()):
        end = gt  # the '>' of each markup
    else:
        j = np.searchsorted(gt, lt)
        if int(j[-1]) >= len(gt):
            return None
        end = gt[j]
        if bool((end[:-1] > lt[1:]).any()):  # a '<' inside a markup
            return None
    first = 1 if body.startswith(b"<?") else 0
    if (first and not _DECL.fullmatch(body, 0, int(end[0]) + 1)) or len(lt) < first + 2:
        return None
    root_at, root_end, last_at = int(lt[first]), int(end[first]), int(lt[-1])
    before = body[int(end[0]) + 1 if first else 0 : root_at]
    if before.strip(_WS) or not _ROOT.fullmatch(body, root_at, root_end + 1):
        return None
    if body[last_at : int(end[-1]) + 1] != _CLOSE_ROOT or body[int(end[-1]) + 1 :].strip(_WS):
        return None
    s, e = lt[first + 1 : -1], end[first + 1 : -1]
    second = a[s + 1]
    if bool((second == 33).any()) or bool((second == 63).any()):  # comments, CDATA, processing instructions
        return None
    closing, empty = second == 47, a[e - 1] == 47
    name_at = s + 1 + closing
    length = e - empty - name_at
    if len(s) and (int(length.min()) < 1 or int(length.max()) > 24 or bool((closing & empty).any())):
        return None
    padded = np.zeros(len(a) + 24, dtype=np.uint8)
    padded[: len(a)] = a
    at = np.ndarray((len(a) + 17,), dtype=np.uint64, buffer=padded.data, strides=(1,))
    words = np.zeros((3, len(s)), dtype=np.uint64)
    words[0] = at[name_at] & _MASKS[np.minimum(length, 8)]
    for k in (1, 2):
        longer = np.flatnonzero(length > 8 * k)
        words[k, longer] = at[name_at[longer] + 8 * k] & _MASKS[np.minimum(length[longer] - 8 * k, 8)]
    return _Markup(s, e, np.append(s[1:], last_at), closing, empty, name_at, length, words)


class _Walk:
    """Markups read one by one, with a stack (where a page is not a run of equal entries): names
    checked, nesting checked, the root's text children and the common prefixes taken."""

    def __init__(self, body: bytes, m: _Markup) -> None:
        self.body, self.m = body, m
        self.texts: dict[bytes, str] = {}
        self.prefixes: list[str] = []

    def name(self, i: int) -> bytes | None:
        at = int(self.m.name_at[i])
        name = self.body[at : at + int(self.m.length[i])]
        return name if _NAME.fullmatch(name) else None

    def text(self, i: int) -> str:
        return _unescape(self.body[int(self.m.e[i]) + 1 : int(self.m.nxt[i])])

    def entry(self, at: int) -> tuple[int, int, int, int] | None:
        """The entry (``Contents``) opening at markup ``at``: (markups it spans, where its Key, Size and
        ETag open (-1: no ETag)); None if it is not one the fast path reads."""
        stack: list[bytes] = []
        found: dict[bytes, list[int]] = {b"Key": [], b"Size": [], b"ETag": []}
        for i in range(at, len(self.m.s)):
            name = self.name(i)
            if name is None:
                return None
            if self.m.closing[i]:
                if stack.pop() != name:
                    return None
                if not stack:
                    key, size, etag = found.values()
                    if len(key) != 1 or len(size) != 1 or len(etag) > 1:
                        return None
                    return i - at + 1, key[0], size[0], etag[0] if etag else -1
            elif self.m.empty[i]:
                if name in _TEXTS:
                    return None
            else:
                if len(stack) == 1 and name in found:
                    found[name].append(i - at)
                stack.append(name)
        return None

    def top(self, lo: int, hi: int) -> bool:
        """Markups ``[lo, hi)`` as children of the root (no entry among them)."""
        stack: list[bytes] = []
        for i in range(lo, hi):
            name = self.name(i)
            if name is None or (self.m.empty[i] and name in _TEXTS) or (not stack and name == b"Contents"):
                return False
            if self.m.closing[i]:
                if not stack or stack.pop() != name:
                    return False
            elif not self.m.empty[i]:
                if not stack and name in _TEXTS:
                    self.texts[name] = self.text(i)
                elif stack == [b"CommonPrefixes"] and name == b"Prefix":
                    self.prefixes.append(self.text(i))
                stack.append(name)
        return not stack


def _fast_page(body: bytes) -> ListPage | None:
    """The page, when the fast path can prove it reads it as ``xml.etree`` would; else None.

    The entries (``Contents``) are read as runs of equal ones: the markups from one entry's opening to
    the next's are compared, as arrays, with the first entry of the same length, whose markups are read
    one by one (:class:`_Walk`); so are the root's other children. A page whose entries differ more
    (their elements in another order, another child) goes to the reference parser.
    """
    a = np.frombuffer(body, dtype=np.uint8)
    m = _markup(body, a) if _clean(body, a) else None
    if m is None:
        return None
    walk = _Walk(body, m)
    count = len(m.s)
    entries = np.flatnonzero((m.words[0] == _CONTENTS) & (m.length == 8) & ~m.closing & ~m.empty)
    n = len(entries)
    fields = np.zeros((3, n), dtype=np.int64)  # where each entry's Key, Size and ETag open
    if n:
        last = walk.entry(int(entries[-1]))
        if last is None:
            return None
        spans = np.append(np.diff(entries), last[0])
        lengths, group = np.unique(spans, return_inverse=True)
        for g, span in enumerate(lengths.tolist()):
            rows = entries[group == g]
            shape = walk.entry(int(rows[0]))
            if shape is None or shape[0] != span:
                return None
            cells = rows[:, None] + np.arange(span)
            for field in (m.words[0], m.words[1], m.words[2], m.length, m.closing, m.empty):
                if not bool((field[cells] == field[cells[0]]).all()):
                    return None
            fields[:, group == g] = rows + np.array(shape[1:])[:, None]
        after = int(entries[-1]) + last[0]
        if not walk.top(0, int(entries[0])) or not walk.top(after, count):
            return None
    elif not walk.top(0, count):
        return None
    encoded = walk.texts.get(b"EncodingType", "").strip().lower() == "url"
    truncated = walk.texts.get(b"IsTruncated", "").strip().lower() == "true"
    token = walk.texts.get(b"NextContinuationToken") or None
    if truncated and token is None:
        return None  # the error is the reference parser's to state
    prefixes = walk.prefixes
    if encoded:
        prefixes = [unquote_plus(p) if "%" in p or "+" in p else p for p in prefixes]
    key, size, etag = fields
    values = _sizes(a, m.e[size] + 1, m.nxt[size])
    if values is None:
        return None
    kb, ko = _keys(body, a, m.e[key] + 1, m.nxt[key], encoded)
    has = etag >= 0
    t_at, t_end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    t_at[has], t_end[has] = m.e[etag[has]] + 1, m.nxt[etag[has]]
    ib, io = _etags(body, a, t_at, t_end)
    return ListPage(Columns(kb, ko, values, ib, io), prefixes, token if truncated else None)


def _keys(body: bytes, a: Any, at: Any, end: Any, encoded: bool) -> tuple[Any, Any]:
    """The keys' texts as they stand, but for those with an entity or, URL-encoded, a '%' or '+'."""
    kb, ko = gather(a, at, end)
    special = kb == 38
    if encoded:
        special |= (kb == 37) | (kb == 43)
    if not bool(special.any()):
        return kb, ko
    texts = [_unescape(body[i:j]) for i, j in zip(at.tolist(), end.tolist(), strict=True)]
    if encoded:
        texts = [unquote_plus(k) if "%" in k or "+" in k else k for k in texts]
    return join_bytes([k.encode("utf-8", "surrogatepass") for k in texts])


def _sizes(a: Any, at: Any, end: Any) -> Any:
    """Sizes of 1 to 16 ASCII digits, at most MAX_LISTED_SIZE; None for anything else (the reference
    parser states the error)."""
    length = end - at
    if not len(at):
        return np.zeros(0, dtype=np.int64)
    if int(length.min()) < 1 or int(length.max()) > 16:
        return None
    digits, offsets = gather(a, at, end)
    d = digits.astype(np.int64) - 48
    if bool(((d < 0) | (d > 9)).any()):
        return None
    place = np.repeat(offsets[1:], length) - 1 - np.arange(len(d))  # the digit's power of ten
    values = np.add.reduceat(d * _POW10[place], offsets[:-1])
    return values if int(values.max()) <= MAX_LISTED_SIZE else None


def _etags(body: bytes, a: Any, at: Any, end: Any) -> tuple[Any, Any]:
    """The ETags' texts, unescaped and stripped of quotes (``str.strip('"')``), as a buffer and offsets:
    ``&quot;`` or ``"`` taken off each end at once; anything less plain one by one."""
    at = at + np.where((end - at >= 6) & (_at6(body, at) == b"&quot;"), 6, 0)
    end = end - np.where((end - at >= 6) & (_at6(body, end - 6) == b"&quot;"), 6, 0)
    ib, io = gather(a, at, end)
    plain = not bool((ib == 38).any())
    if plain and len(ib):
        filled = io[:-1] < io[1:]
        plain = not bool((ib[io[:-1][filled]] == 34).any()) and not bool((ib[io[1:][filled] - 1] == 34).any())
    if plain:
        return ib, io
    texts = [_unescape(body[i:j]).strip('"') for i, j in zip(at.tolist(), end.tolist(), strict=True)]
    return join_bytes([t.encode("utf-8", "surrogatepass") for t in texts])
