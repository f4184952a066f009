"""Output folders dtdsl writes, and replaces only when it can tell they are its own.

dtdsl writes three kinds of folder: datasets (``data.shards``), launch bundles
(``codegen.emit``) and Hugging Face directories (``models.hf.save_hf``, ``dtc export``).
Each records every file it wrote with its sha256 (the dataset's index, the bundle's
manifest, ``RECORD`` here), and replacing one follows the same rules:

- the record's names are plain relative paths inside the folder (``check_name``: no
  ``..``, no absolute path), and no folder above one of them is a symbolic link;
- ``verify_owned`` walks the folder without following links: every file is one the
  record lists, with the checksum the record gives; a link, an unlisted file or folder
  or a changed file is refused, naming it, before anything is written or removed
  (``keep`` spares what a caller leaves alone: a bundle's run directories);
- the new contents go into a fresh folder beside the target (``stage``) and are swapped
  in with two renames (``Staged.commit``) once the old folder is seen unchanged since it
  was verified, so a refusal, an error or a crash part-way leaves the old folder whole;
  then the replaced files are removed, only those verified. (The folder itself is
  replaced: a shell inside it is left in the removed one. An empty folder is filled
  instead, its record last.)

Nothing here deletes a file that is not listed, or one whose checksum no longer matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtdsl.errors import DtdslError

__all__ = ["Listed", "OutputError", "RECORD", "Snapshot", "Staged", "check_name", "file_kind",
           "file_sha256", "fresh_dir", "read_bounded", "read_record", "real_dir", "replace_folder",
           "stage", "verify_owned", "verify_recorded", "write_record"]

RECORD = "dtdsl-manifest.json"      # what a Hugging Face directory of dtdsl's holds
_RECORD_FORMAT = "dtdsl-files"
_SHOWN = 3                          # names shown in a message, then "..."

Keep = Callable[[str, os.stat_result], bool]


class OutputError(DtdslError, ValueError):
    """An output folder dtdsl will not write into or replace; the message names why."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a directory"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` that is not a regular file is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of ``path``, at most ``limit + 1`` (more than ``limit``: the file is longer
    than the caller takes), if it is a regular file. Opened without blocking (a FIFO's open
    waits for a writer) and checked before it is read: a FIFO or a device would never end.
    OSError for what the system says; ValueError for a file of another kind."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{os.fspath(path)} is {file_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    return data


def file_sha256(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_name(name: object, record: str) -> str:
    """``name`` from ``record`` when it is a plain relative POSIX path (no empty, ``.`` or
    ``..`` part, not absolute, no backslash): a record cannot point outside its folder."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or \
            name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        raise OutputError(f"{record} lists {name!r}, which is not a plain file name inside "
                          "its folder; nothing was changed (a record dtdsl did not write? "
                          "remove the folder by hand if it is yours)")
    return name


def real_dir(path: Path) -> bool:
    """Whether ``path`` is a folder (False: nothing there). OutputError for a symbolic
    link (dtdsl never writes through one), a file, or a path that cannot be one (a file
    among its parents, a name too long)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise OutputError(f"{path}: one of its parents is a file, not a folder") from None
    except OSError as err:
        raise OutputError(f"{path}: {err.strerror or err}") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{path} is a symbolic link; dtdsl does not write through links: "
                          "give the real folder, or a new one")
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path} exists and is not a directory")
    return True


@dataclass(frozen=True)
class Listed:
    """What a record says of one file: its sha256 (any of ``sha256``) and size, or a
    ``check`` of its own; ``Listed()`` accepts any regular file (the record itself)."""

    sha256: frozenset[str] = frozenset()
    size: int | None = None
    check: Callable[[Path], bool] | None = None

    def matches(self, path: Path, st: os.stat_result) -> bool:
        if self.size is not None and st.st_size != self.size:
            return False
        if self.check is not None:
            return self.check(path)
        return not self.sha256 or file_sha256(path) in self.sha256


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _walk(root: Path, keep: Keep) -> dict[str, os.stat_result]:
    """Every entry under ``root`` (links not followed) by relative path, but what
    ``keep`` spares (not descended into)."""
    found: dict[str, os.stat_result] = {}

    def visit(folder: Path, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                rel = prefix + entry.name
                st = entry.stat(follow_symlinks=False)
                if keep(rel, st):
                    continue
                found[rel] = st
                if stat.S_ISDIR(st.st_mode):
                    visit(Path(entry.path), rel + "/")

    visit(root, "")
    return found


def _parents(names: Iterable[str]) -> set[str]:
    out = set()
    for name in names:
        parts = name.split("/")
        out.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return out


def _shown(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


@dataclass(frozen=True)
class Snapshot:
    """A verified folder: the listed files found there, and the state of everything
    walked, to tell a change since (``recheck``)."""

    root: Path
    exists: bool
    ours: tuple[str, ...] = ()                  # listed files found, relative
    folders: tuple[str, ...] = ()               # folders walked, relative
    state: Mapping[str, Any] = field(default_factory=dict)
    keep: Keep = field(default=lambda rel, st: False)

    @property
    def empty(self) -> bool:
        """Whether the folder was there and empty (one someone made for the output)."""
        return self.exists and not self.ours and self.state.get("/", (0, ()))[1] == ()

    @classmethod
    def take(cls, root: Path, ours: Iterable[str], keep: Keep,
             found: dict[str, os.stat_result] | None = None) -> Snapshot:
        if not real_dir(root):
            return cls(root=root, exists=False, keep=keep)
        if found is None:
            found = _walk(root, keep)
        state = {rel: _identity(st) for rel, st in found.items()
                 if not stat.S_ISDIR(st.st_mode)}
        folders = [rel for rel, st in found.items() if stat.S_ISDIR(st.st_mode)]
        # A folder by what is in it (its times change when dtdsl stages inside it).
        for rel in ["", *folders]:
            where = root / rel if rel else root
            state[rel + "/"] = (os.lstat(where).st_ino, tuple(
                sorted(r for r in found if r.rpartition("/")[0] == rel)))
        return cls(root=root, exists=True, ours=tuple(sorted(set(ours) & set(found))),
                   folders=tuple(folders), state=state, keep=keep)

    def recheck(self) -> None:
        """OutputError when anything verified has changed since (then nothing is
        replaced)."""
        if not self.exists:
            return
        again = Snapshot.take(self.root, self.ours, self.keep)
        if again.state != self.state:
            changed = sorted(k for k in self.state.keys() | again.state.keys()
                             if self.state.get(k) != again.state.get(k))
            raise OutputError(f"{self.root} changed while dtdsl was writing "
                              f"({_shown(changed)}); nothing was replaced: run again")

    def remove_ours(self, where: Path) -> None:
        """Remove the verified files and folders from ``where`` (the folder moved aside),
        then ``where`` itself; OutputError if anything else is left there."""
        for rel in self.ours:
            path = where / rel
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and _identity(st) == self.state.get(rel):
                path.unlink()
        for rel in sorted(self.folders, key=lambda r: -r.count("/")):
            _rmdir_quietly(where / rel)
        _rmdir_quietly(where)
        if where.exists():
            raise OutputError(f"{self.root} is replaced; the old folder, moved to {where}, "
                              "still holds files dtdsl did not write and is kept")


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def verify_owned(root: Path, listed: Mapping[str, Listed], *, record: str,
                 keep: Keep = lambda rel, st: False, writes: Iterable[str] = (),
                 contents: bool = True) -> Snapshot:
    """Check that ``root`` (absent, or a real folder) holds only what ``record`` lists
    (``listed``: name -> what it is) and what ``keep`` spares, with no link on the way to
    a listed name or one of ``writes`` (names to be written); with ``contents``, that
    every listed file present is unchanged. OutputError naming the first problem."""
    names = [check_name(n, record) for n in (*listed, *writes)]
    if not real_dir(root):
        return Snapshot(root=root, exists=False, keep=keep)
    for parent in sorted(_parents(names)):
        if (root / parent).is_symlink():
            raise OutputError(f"{root / parent} is a symbolic link; dtdsl does not write "
                              "through links: nothing was changed")
    found = _walk(root, keep)
    parents = _parents(names)
    links = [rel for rel, st in found.items() if stat.S_ISLNK(st.st_mode)]
    if links:
        raise OutputError(f"{root / links[0]} is a symbolic link, which dtdsl does not "
                          "write; nothing was changed: remove it, or write into another "
                          "folder")
    foreign = [rel + "/" if stat.S_ISDIR(st.st_mode) else rel for rel, st in found.items()
               if not (rel in parents and rel not in listed if stat.S_ISDIR(st.st_mode)
                       else stat.S_ISREG(st.st_mode) and rel in listed)]
    if foreign:
        raise OutputError(f"{root} holds files dtdsl did not write ({_shown(foreign)}); "
                          f"{record} does not list them and nothing was changed: move them "
                          "away, or write into another folder")
    if contents:
        for rel in sorted(set(listed) & set(found)):
            if not listed[rel].matches(root / rel, found[rel]):
                raise OutputError(f"{root / rel} was changed after dtdsl wrote it (it is not "
                                  f"what {record} records); nothing was changed: move it "
                                  "away, or write into another folder")
    return Snapshot.take(root, listed, keep, found)


def fresh_dir(parent: Path, prefix: str) -> Path:
    """A new empty folder ``parent/prefix<random>`` (made with the usual mode)."""
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


@dataclass(frozen=True)
class Staged:
    """A folder's new contents, written into ``path`` beside ``target``; ``last``: the
    file that says the contents are complete (the record), moved in last."""

    target: Path
    path: Path
    snapshot: Snapshot
    last: str = ""

    def commit(self) -> None:
        """Swap ``path`` in for ``target`` (module docstring). An empty folder someone made
        is filled instead (its owner, mode, and a shell sitting in it, stay)."""
        target = self.target
        if not self.snapshot.exists:
            os.replace(self.path, target)     # fails on a folder that appeared, non-empty
            return
        self.snapshot.recheck()
        if self.snapshot.empty:
            for entry in sorted(self.path.iterdir(), key=lambda p: (p.name == self.last,
                                                                    p.name)):
                os.replace(entry, target / entry.name)
            self.path.rmdir()
            return
        os.chmod(self.path, stat.S_IMODE(os.lstat(target).st_mode))
        aside = fresh_dir(target.parent, f".{_short(target.name)}.dtdsl-old-")
        os.replace(target, aside)
        try:
            os.replace(self.path, target)
        except OSError:
            os.replace(aside, target)
            raise
        self.snapshot.remove_ours(aside)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def stage(target: Path, snapshot: Snapshot, last: str = RECORD) -> Staged:
    """A fresh folder beside ``target`` (verified as ``snapshot``) for its new contents,
    ``last`` the record that completes them."""
    target = Path(os.path.abspath(target))      # "." has no name and no folder beside it
    return Staged(target=target, path=fresh_dir(target.parent,
                                                f".{_short(target.name)}.dtdsl-new-"),
                  snapshot=snapshot, last=last)


def _short(name: str, limit: int = 96) -> str:
    """``name`` cut to at most ``limit`` UTF-8 bytes: the temporary folders named after
    a target stay within a file name's 255 bytes, whatever the target's length."""
    return os.fsdecode(os.fsencode(name)[:limit])


def write_record(folder: Path, **fields: Any) -> None:
    """``RECORD`` in ``folder``: the size and sha256 of every file there (all dtdsl's)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != RECORD:
            files[path.relative_to(folder).as_posix()] = {
                "size": path.stat().st_size, "sha256": file_sha256(path)}
    body = {"format": _RECORD_FORMAT, "version": 1, **fields, "files": files}
    (folder / RECORD).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def read_record(folder: Path) -> dict[str, Listed] | None:
    """What ``folder``'s ``RECORD`` lists (itself included), or None when it has none.
    OutputError for a record that is not one."""
    path = folder / RECORD
    if not path.is_file() or path.is_symlink():
        return None
    try:
        body = json.loads(path.read_bytes())
        files = body["files"] if body.get("format") == _RECORD_FORMAT else None
        if not isinstance(files, dict):
            raise ValueError(f"no \"format\": \"{_RECORD_FORMAT}\" with its files")
        listed = {RECORD: Listed()}
        for name, entry in files.items():
            check_name(name, str(path))
            size, sha = entry["size"], entry["sha256"]
            if not isinstance(size, int) or not isinstance(sha, str):
                raise ValueError(f"{name}: size and sha256 are not a count and a digest")
            listed[name] = Listed(sha256=frozenset({sha}), size=size)
    except OSError as err:
        raise OutputError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise OutputError(f"{path} is not a record dtdsl wrote ({err}); nothing was changed: "
                          "remove the folder by hand if it is yours") from None
    return listed


def verify_recorded(folder: Path) -> Snapshot:
    """That ``folder`` may be replaced by a folder with a ``RECORD``: it is new or empty,
    or holds a ``RECORD`` and exactly what it lists, unchanged. OutputError otherwise."""
    if not real_dir(folder) or not any(folder.iterdir()):
        return Snapshot.take(folder, (), lambda rel, st: False)
    listed = read_record(folder)
    if listed is None:
        names = sorted(p.name for p in folder.iterdir())
        raise OutputError(f"{folder} holds files dtdsl did not write ({_shown(names)}): it has "
                          f"no {RECORD} (someone else's, or written by a dtdsl that kept "
                          "none); nothing was changed: remove it by hand, or write into "
                          "another folder")
    return verify_owned(folder, listed, record=str(folder / RECORD))


def replace_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """Fill a new folder beside ``folder`` with ``write(new)`` and a ``RECORD``, then swap
    it in for ``folder`` (``verify_recorded`` first: OutputError, nothing changed)."""
    staged = stage(folder, verify_recorded(folder))
    try:
        write(staged.path)
        write_record(staged.path)
        staged.commit()
    except BaseException:
        staged.discard()
        raise
