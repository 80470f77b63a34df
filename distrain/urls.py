"""A place given on the command line (run.storage, data.shards, an output): a local path, or a URL of an object
store (s3://bucket/prefix, any fsspec URL). A URL is never taken for a local path: text that starts like one
(`s3:`) but is not well-formed (`s3:/runs`, `s3:///runs`) would otherwise name a local folder `s3:`, so it is
refused, as is a scheme no installed filesystem serves. Also where a URL's local mirror is on this node. Pure
text but for the filesystem lookup (fsspec, lazily) and the node's cache folder (its environment).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

# The filesystem package of each cloud's schemes, and distrain's extra that installs it.
EXTRAS = {
    **dict.fromkeys(("s3", "s3a"), ("s3fs", "s3")),
    **dict.fromkeys(("gs", "gcs"), ("gcsfs", "gcs")),
    **dict.fromkeys(("az", "abfs", "abfss"), ("adlfs", "azure")),
}
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
# A scheme and a colon at the start: what a URL begins with. Two letters at least: `C:` is no scheme.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
# Schemes whose URLs name a local path, not a bucket: file:///tmp/x is whole without one.
LOCAL_SCHEMES = ("file", "local", "memory")


def is_url(text: str | None) -> bool:
    """Whether `text` is a URL (scheme://...) rather than a local path."""
    return bool(text and URL.match(text))


def looks_like_url(text: str | None) -> bool:
    """Whether `text` starts like a URL (`scheme:`), well-formed or not: never a plain local path."""
    return bool(text and _SCHEME.match(text))


def bucket(url: str) -> str | None:
    """The bucket (container) a URL names, None for a scheme without buckets (file://)."""
    scheme, rest = URL.match(url).groups()
    return None if scheme in LOCAL_SCHEMES else rest.split("/", 1)[0]


def check_location(text: str, key: str) -> None:
    """ValueError in one line, naming `key`, if `text` starts like a URL but is not a well-formed one (a scheme,
    `://`, a bucket), or if no installed fsspec filesystem serves its scheme. A plain path passes."""
    found = _SCHEME.match(text)
    if not found:
        return
    scheme = found[1]
    if not is_url(text) or bucket(text) == "":
        rest = text[len(scheme) + 1 :].lstrip("/")
        fix = f"{scheme}:///{rest}" if scheme in LOCAL_SCHEMES else f"{scheme}://{rest or 'BUCKET/PREFIX'}"
        raise ValueError(
            f"{key}={text!r} is not a well-formed URL: write {fix} (scheme://bucket/prefix), or ./{text} for a local "
            f"folder of that name"
        )
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as e:
        package, extra = EXTRAS.get(scheme, (None, None))
        hint = f" (pip install {package}, or the `{extra}` extra: pip install -e '.[{extra}]')" if package else ""
        raise ValueError(f"{key}={text!r}: no filesystem for {scheme}:// is installed ({e}){hint}") from None


def run_location(storage: str, name: str) -> str:
    """Where the run `name` of `storage` is: a directory, or a URL on an object store."""
    return f"{storage.rstrip('/')}/{name}" if is_url(storage) else str(Path(storage) / name)


NODE_CACHE_ENV = "DISTRAIN_CACHE_DIR"  # a node's own cache folder, over storage.cache_dir (set where Ray starts)


def mirror_dir(url: str, cache_dir: str | Path) -> Path:
    """The local mirror of `url` under this node's cache folder (DISTRAIN_CACHE_DIR in this process's
    environment, else `cache_dir`): readable (scheme, then the URL's path) and unique. Computed where it is
    used: each node's mirror is its own, never assumed shared."""
    scheme, rest = URL.match(url).groups()
    tag = hashlib.sha1(url.encode()).hexdigest()[:8]
    root = Path(os.environ.get(NODE_CACHE_ENV) or cache_dir).expanduser()
    return root / "mirror" / scheme / f"{rest.strip('/')}-{tag}"
