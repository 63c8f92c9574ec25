"""A listing remembered under the cache home (``BLOBDATA_CACHE_HOME``): reused while young enough, and
said once per process at WARNING with its age and how to list again; read only when it is the user's
own file in a directory no one else can write, and written only there."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._config import parse_duration
from .._errors import ConfigError, ManifestError, NotFound
from .._node import check_shared_dir
from .manifest import Manifest, load_own

__all__ = ["REMEMBERED_RECORD", "load_remembered", "remember_listing"]

logger = logging.getLogger(__name__)

_said: set[str] = set()


def _say_once(key: str, msg: str, *args: Any, extra: Mapping[str, Any] | None = None) -> bool:
    """Log ``msg`` at WARNING the first time ``key`` is said in this process; whether it was."""
    if key in _said:
        return False
    _said.add(key)
    logger.warning(msg, *args, extra=extra)
    return True


#: Set on the log record that says a remembered listing is used: a command line that prints its own
#: line for it can leave the record out.
REMEMBERED_RECORD = "blobdata_remembered_listing"


def _human_age(seconds: float) -> str:
    for unit, n in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= n:
            return f"{seconds / n:.1f} {unit}"
    return f"{seconds:.0f} s"


#: What chose the directory of remembered listings (named in messages about it).
_HOME = "BLOBDATA_CACHE_HOME"


def load_remembered(path: Path, root: str, max_age: float | str | None) -> Manifest | None:
    """The listing of ``root`` remembered at ``path`` if there is one, usable and younger than
    ``max_age`` (None: any age); else None, and the caller lists again (an unusable file is said at
    WARNING, one too old at INFO). The cache home is a place other users of the node may reach: a
    file that is not this user's own (another user's, a link, writable by others, in a directory
    others can write) is never mapped, only said at WARNING (:func:`~blobdata._node.open_own`). A
    listing reused is said at WARNING, once per process and file, with its age and how to list again:
    the first loop with one's own data is upload, run, upload again."""
    limit = None if max_age is None else parse_duration(max_age, name="listing_max_age")
    try:
        loaded = load_own(path, setting=_HOME, expect_root=root)
    except NotFound:
        return None
    except ConfigError as exc:
        logger.warning("remembered listing of %s not used: %s; listing %s again", root, exc, root)
        return None
    except ManifestError as exc:
        logger.warning("remembered listing %s is unusable (%s); listing %s again", path, exc, root)
        return None
    age = max(0.0, time.time() - loaded.listed_at)
    if limit is not None and age > limit:
        logger.info("remembered listing of %s is %s old (listing_max_age=%s): listing again",
                    root, _human_age(age), max_age)  # fmt: skip
        return None
    said = _say_once(
        f"remembered|{path}",
        "using the remembered listing of %s, made %s ago (%d objects): objects uploaded, changed or removed "
        "since are not in it; refresh=True (blobdata ... --refresh) lists the bucket again, listing_max_age= "
        "bounds the age of a listing reused (default 7 days)",
        root, _human_age(age), len(loaded), extra={REMEMBERED_RECORD: root},
    )  # fmt: skip
    if not said:
        logger.info("using the remembered listing of %s from %s ago (%d objects)", root, _human_age(age),
                    len(loaded))  # fmt: skip
    return loaded


def remember_listing(listed: Manifest, path: Path) -> Manifest:
    """``listed`` saved at ``path`` and mapped from there (the node's other processes share its pages);
    ``listed`` itself, with a WARNING, where it cannot be: a directory other users could write (or
    that is not this user's) is never written to."""
    try:
        check_shared_dir(str(path.parent), setting=_HOME)
        listed.save(path)
        return load_own(path, setting=_HOME, expect_root=listed.root)
    except (OSError, ConfigError, ManifestError, NotFound) as exc:
        logger.warning("could not remember the listing of %s in %s: %s", listed.root, path, exc)
        return listed
