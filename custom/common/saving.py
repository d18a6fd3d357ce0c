"""Writing a torch file so that a failure names the file: ``torch.save`` under a file-size limit (``ulimit -f``) or
on a full disk raises ``RuntimeError: [enforce fail at inline_container.cc:...] ... file write failed``, which names
neither the file nor the cause; and a file cut short by it would be read back later as a damaged checkpoint."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["save_torch"]


def save_torch(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` into ``path`` through a temporary file beside it, moved into place when complete (a reader
    never sees a partial file). Returns ``Path(path)``.

    Raises:
        OSError: the write failed (errno kept where the system gave one); the message names ``path`` and the likely
            cause (a file-size limit or a full disk when torch's stream writer failed), with torch's own words after.
    """
    import torch

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (RuntimeError, OSError) as e:
        tmp.unlink(missing_ok=True)
        code = getattr(e, "errno", None)
        full = code in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT) or "file write failed" in str(e) or \
            "inline_container" in str(e)
        why = "a file-size limit (ulimit -f) or a full disk stopped the write" if full else "the write failed"
        raise OSError(code or errno.EIO, f"cannot write {path}: {why} ({type(e).__name__}: "
                                         f"{str(e).strip().splitlines()[0] if str(e).strip() else e})") from None
    return path
