"""Atomic publishing of an export artifact (no Keras import).

`Staging(path)` is a staging folder next to `path`: the artifact is built
there and moved into place with one atomic rename (`publish`), so `path`
always holds either the complete old artifact or the complete new one. It
holds an exclusive lock on `path`, removes the staging folders of killed
exports (putting back an artifact an overwrite left in `previous`) and turns
SIGTERM into an exception while it is open. `refuse_dangerous(path)` rejects
targets whose replacement would destroy a home or working folder.
"""

import errno
import os
import re
import shutil
import signal
import tempfile
import threading

from kerasmp.export.quiet import say

_STAGE_PREFIX = ".kerasmp-export-"
_STAGE_RE = re.compile(r"\.kerasmp-export-(\d+)-[A-Za-z0-9_]+")
_LOCK_PREFIX = ".kerasmp-export-lock-"

# Test hook: called as `_before_publish(staged, path)` right before the
# artifact is moved into place (tests pause or kill the process there).
_before_publish = None


def refuse_dangerous(path):
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    name = os.path.basename(os.path.normpath(path))
    reason = None
    if real == os.path.realpath(os.sep) or real == os.path.dirname(real):
        reason = "the filesystem root"
    elif real == home:
        reason = "the home folder"
    elif cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        reason = "the working directory or a folder holding it"
    elif name in ("", ".", ".."):
        reason = "not a file or folder name"
    if reason:
        raise ValueError(
            f"Invalid `path`: {path!r} is {reason}; an export replaces "
            "what is at `path`, so give it a new file or folder name "
            "(e.g. 'exported_model')."
        )


def _pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _clean_stale(parent):
    """Removes staging folders of exports whose process is gone.

    A folder holding `previous` is an overwrite killed between its two
    renames (the fallback without `renameat2`): if its target is missing,
    the previous artifact is put back first. Returns what was removed.
    """
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        if entry.startswith(_LOCK_PREFIX) and _drop_stale_lock(
            os.path.join(parent, entry)
        ):
            removed.append(os.path.join(parent, entry))
            continue
        m = _STAGE_RE.fullmatch(entry)
        stage = os.path.join(parent, entry)
        if not m or not os.path.isdir(stage) or _pid_alive(int(m.group(1))):
            continue
        previous = os.path.join(stage, "previous")
        try:
            with open(os.path.join(stage, "target")) as f:
                target = os.path.join(parent, f.read().strip())
        except OSError:
            target = None
        if target and os.path.lexists(previous) and not os.path.lexists(
            target
        ):
            os.rename(previous, target)
            say(
                f"kerasmp.export: restored {target!r} from {stage!r}, left "
                "by an export killed while replacing it.")
        shutil.rmtree(stage, ignore_errors=True)
        removed.append(stage)
    if removed:
        say(
            "kerasmp.export: removed staging folders left by killed exports"
            f": {', '.join(removed)}")
    return removed


def _drop_stale_lock(lock_path):
    """Removes a lock file that no process holds (its export was killed)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # held: an export is running
    try:
        os.unlink(lock_path)
    except OSError:
        pass
    os.close(fd)
    return True


class _Terminated(BaseException):
    """SIGTERM during an export, raised so that the staging is removed."""


class Staging:
    """A staging folder next to `path`, removed on every exit Python sees.

    Holds an exclusive lock on `path` (a `.kerasmp-export-lock-<name>` file
    in the same folder) so a concurrent export to the same path fails at
    once, cleans up stale staging folders of killed exports, and turns
    SIGTERM into an exception while it is open (the main thread only) so
    the staging folder is removed before the signal takes effect.
    """

    def __init__(self, path):
        self.path = path
        self.parent = os.path.dirname(os.path.abspath(path))
        self.name = os.path.basename(os.path.normpath(path))
        self.dir = None
        self._lock = None
        self._old_handler = None

    def __enter__(self):
        os.makedirs(self.parent, exist_ok=True)
        self._acquire_lock()
        try:
            _clean_stale(self.parent)
            self.dir = tempfile.mkdtemp(
                prefix=f"{_STAGE_PREFIX}{os.getpid()}-", dir=self.parent
            )
            with open(os.path.join(self.dir, "target"), "w") as f:
                f.write(self.name)
            self._install_sigterm()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, kind, exc, tb):
        self._release()
        if kind is _Terminated:
            handler = self._old_handler
            if callable(handler):
                handler(signal.SIGTERM, None)
                raise SystemExit(128 + signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # default action now
        return False

    def _acquire_lock(self):
        try:
            import fcntl
        except ImportError:  # not POSIX: the publish still never clobbers
            return
        lock_path = os.path.join(self.parent, _LOCK_PREFIX + self.name)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(
                f"Another export is writing `path` {self.path!r} right now "
                f"(it holds {lock_path!r}); nothing was written. Wait for "
                "it or choose another path."
            ) from None
        self._lock = (fd, lock_path)

    def _install_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return
        old = signal.getsignal(signal.SIGTERM)
        if old is signal.SIG_IGN or old is None:
            return

        def on_sigterm(signum, frame):
            raise _Terminated()

        self._old_handler = old
        signal.signal(signal.SIGTERM, on_sigterm)

    def _release(self):
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._lock is not None:
            fd, lock_path = self._lock
            self._lock = None
            try:
                os.unlink(lock_path)
            except OSError:
                pass
            os.close(fd)

    def publish(self, staged, overwrite, path=None):
        """Moves `staged` to `path` atomically; see `_publish`.

        `path` defaults to the staging's own; another path (one of several
        artifacts published from one staging folder, as the demo does) must
        be in the same folder, so the rename stays atomic.
        """
        path = self.path if path is None else path
        backup = "previous"
        if path != self.path:
            if os.path.dirname(os.path.abspath(path)) != self.parent:
                raise ValueError(
                    f"{path!r} is not in the staging's folder "
                    f"{self.parent!r}.")
            # Not `previous`: only the staging's own path is put back by
            # `_clean_stale`.
            backup = "previous-" + os.path.basename(path)
        if _before_publish is not None:
            _before_publish(staged, path)
        _publish(staged, path, overwrite, os.path.join(self.dir, backup))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_renameat2_fn = None


def _renameat2(src, dst, flags):
    """Linux renameat2(2). Returns False where unavailable/unsupported."""
    global _renameat2_fn
    if _renameat2_fn is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            _renameat2_fn = (libc.renameat2, ctypes)
        except (OSError, AttributeError):
            _renameat2_fn = False
    if not _renameat2_fn:
        return False
    fn, ctypes = _renameat2_fn
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
          flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _appeared(path):
    return FileExistsError(
        f"`path` {path!r} appeared while exporting (another export or "
        "process wrote it); it was left as it is and nothing was written. "
        "Pass overwrite=True to replace it."
    )


def _publish(staged, path, overwrite, backup):
    """Moves `staged` to `path` so that `path` never holds a partial state.

    Without `overwrite`: a rename that fails if `path` exists
    (`RENAME_NOREPLACE`; else a hard link for a file, or reserving `path`
    with mkdir and renaming onto that empty folder). With `overwrite`: an
    atomic swap of old and new (`RENAME_EXCHANGE`, or `os.replace` for a
    file); the old artifact lands in the staging folder and goes with it.
    Where neither works (a folder, no renameat2), two renames: the old
    artifact to `backup` in the staging folder, then the new one into place;
    a kill between them leaves the complete old artifact in `backup`, which
    the next export to this folder puts back.
    """
    if not overwrite or not os.path.lexists(path):
        try:
            if _renameat2(staged, path, _RENAME_NOREPLACE):
                return
            if os.path.isdir(staged):
                os.mkdir(path)
                try:
                    os.rename(staged, path)
                except OSError:
                    os.rmdir(path)
                    raise
            else:
                os.link(staged, path)
                os.unlink(staged)
            return
        except FileExistsError:
            if not overwrite:
                raise _appeared(path) from None
    if _renameat2(staged, path, _RENAME_EXCHANGE):
        return
    if not os.path.isdir(staged) and not os.path.isdir(path):
        os.replace(staged, path)
        return
    os.rename(path, backup)
    os.rename(staged, path)


