"""Checks of a path kerasmp will write to, made before any work.

`check_output` is a file or folder written at a path (an export, a JSON
result), `check_output_folder` a folder that files are written into (the
demo's artifacts). Both check that the folder the path goes in exists and is
writable (a typo in a path must not create folders), and raise errors naming
the argument, which the `kerasmp` command rewords with its flags.
"""

import os


def as_path(path, argname="path", kind="file"):
    """`path` as a `str`; a `TypeError` naming `argname` if it is not one.

    Args:
        path: A `str` or `os.PathLike`, not empty.
        argname: The argument's name, for the error.
        kind: `"file"` or `"folder"`, for the error.

    Returns:
        `os.fspath(path)`.

    Example:

    >>> as_path(pathlib.Path("model.keras"))
    'model.keras'
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(
            f"`{argname}` must be a {kind} path. Received: {path!r}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        raise TypeError(f"`{argname}` must be a str path. Received: {path!r}")
    return path


def _is_wrong_kind(path, argname, folder):
    """The error for a file where a folder is expected, or the reverse."""
    found, expected = ("a file", "folder") if folder else ("a folder", "file")
    return ValueError(
        f"`{argname}` {path!r} is {found}; expected a {expected} path.")


def _check_writable(path, folder, argname):
    """`folder`, where `path` is written, exists and can be written in."""
    if not os.path.isdir(folder):
        kind = ("is not a folder" if os.path.exists(folder)
                else "does not exist; create it first")
        raise ValueError(f"`{argname}` {path!r}: its folder {folder!r} "
                         f"{kind}.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"`{argname}` {path!r}: cannot write in {folder!r} "
                         "(permission denied).")


def check_output(path, overwrite=False, folder=False, argname="path"):
    """Checks a path a file (or a folder) will be written at.

    In this order: `path` is a non-empty `str` or `os.PathLike`;
    `overwrite` is a bool; an existing `path` is refused unless
    `overwrite`, and with `overwrite` it must be of the kind written (a
    folder for `folder=True`, else not a folder); the folder `path` goes in
    exists and is writable.

    Args:
        path: The output path.
        overwrite: Whether an existing `path` may be replaced.
        folder: Whether a folder (not a file) is written at `path`.
        argname: The argument's name in the errors.

    Returns:
        `path` as a `str`.

    Raises:
        TypeError: `path` or `overwrite` of the wrong type.
        FileExistsError: `path` exists and `overwrite` is False.
        ValueError: `path` is of the wrong kind, or its folder is missing,
            not a folder or not writable.

    Example:

    >>> check_output("result.json", overwrite=True)
    'result.json'
    """
    path = as_path(path, argname, "folder" if folder else "file")
    if not isinstance(overwrite, bool):
        raise TypeError(
            f"`overwrite` must be True or False. Received: {overwrite!r}")
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(
                f"`{argname}` {path!r} already exists; pass overwrite=True "
                "to replace it.")
        if os.path.isdir(path) != folder:
            raise _is_wrong_kind(path, argname, folder)
    _check_writable(path, os.path.dirname(os.path.abspath(path)), argname)
    return path


def check_output_folder(path, argname="path"):
    """Checks a folder that files will be written into.

    The folder is made if it does not exist (its parent must) and reused
    if it does (it must be writable); a file at `path` is refused.

    Args:
        path: The folder's path.
        argname: The argument's name in the errors.

    Returns:
        `path` as a `str`.

    Raises:
        TypeError: `path` is not a path.
        ValueError: `path` is a file, or the folder it goes in is missing,
            not a folder or not writable.

    Example:

    >>> check_output_folder("kerasmp-demo")
    'kerasmp-demo'
    """
    path = as_path(path, argname, "folder")
    if os.path.isdir(path):
        _check_writable(path, path, argname)
    elif os.path.exists(path):
        raise _is_wrong_kind(path, argname, folder=True)
    else:
        _check_writable(path, os.path.dirname(os.path.abspath(path)),
                        argname)
    return path
