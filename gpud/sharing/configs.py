"""Named sharing configs: a directory of files, one per name, as a mounted Kubernetes ConfigMap gives
them (NAME -> ..data/NAME -> ..<timestamp>/NAME), which one is in force and why.

The one in force is the name chosen through PUT /v1/sharing/config (persisted in the state
directory) when the directory holds it, else sharing.default_config, else sharing.file. A name is a
ConfigMap key; its file, once the ConfigMap's links are followed, must stay inside the directory.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.logs import get_logger
from gpud.base.persist import CorruptFile, read_json, write_failed, write_json_atomic
from gpud.base.safefs import UnsafePath
from gpud.model.inventory import Inventory
from gpud.model.names import config_name_problem
from gpud.sharing.config import SharingConfig, SharingConfigError
from gpud.sharing.resources import mps_replicas
from gpud.sharing.service import read_sharing_file

log = get_logger("sharing")

# How often the file in force (and the directory's names) is looked at between reloads: a stat of
# the directory and of the file in force; the directory is listed again only when it changed (a
# ConfigMap update swaps its ..data link: the directory changes).
POLL_INTERVAL_S = 2.0
MAX_REASON_LENGTH = 1024
# Names read from sharing.configs_dir: a ConfigMap holds at most 1 MiB (Kubernetes'
# MaxSecretSize/ConfigMap limit), some hundreds of configs; a directory of more entries is not
# walked whole (each name is a realpath), and says so.
MAX_CONFIG_NAMES = 1024
# A directory changed this recently may change again within the same tick of its timestamp, which
# then stays as it was: a listing is trusted only once the directory's last change is older than the
# listing by this much (git/git Documentation/technical/racy-git.adoc: the same rule for the index).
RACY_S = 1.0


@dataclass(frozen=True)
class Choice:
    """What PUT /v1/sharing/config chose last: a name, or None for the default."""

    name: str | None
    reason: str | None
    chosen_at: float

    def document(self) -> dict:
        return {"name": self.name, "reason": self.reason, "chosen_at": self.chosen_at}


def _choice_from(document: dict) -> Choice:
    name, reason, chosen_at = document["name"], document.get("reason"), document["chosen_at"]
    if name is not None and (not isinstance(name, str) or config_name_problem(name)):
        raise ValueError(f"name must be a config name or null, not {name!r}")
    if reason is not None and not isinstance(reason, str):
        raise ValueError(f"reason must be a string or null, not {reason!r}")
    if isinstance(chosen_at, bool) or not isinstance(chosen_at, (int, float)):
        raise ValueError(f"chosen_at must be a time, not {chosen_at!r}")
    return Choice(name, reason, float(chosen_at))


class Listing(NamedTuple):
    """One listing of configs_dir: what the directory was (_identity) and when it was listed, the names
    that are configs, what is wrong (too many names), and the first name past MAX_CONFIG_NAMES."""

    identity: tuple | None
    listed_at: float
    names: list[str]
    problem: str | None
    first_past_cap: str | None

    def trusted(self, identity: tuple | None) -> bool:
        """Whether the directory, now `identity`, still holds what this listing found."""
        return identity is not None and identity == self.identity and identity[3] < (self.listed_at - RACY_S) * 1e9


class Candidate(NamedTuple):
    """A file that may be in force: its name in the directory (None: sharing.file), its path, and why."""

    name: str | None
    path: Path
    why: str


class SharingConfigs:
    """Which sharing config is in force and why. `config` and `in_force` are what was last read
    successfully; `problem` says what is wrong beside it (a chosen name that is gone, a new content
    that is invalid)."""

    def __init__(self, file: str, configs_dir: str | None, default: str | None, choice_path: Path):
        self._choice_path = choice_path
        self.choice: str | None = None
        self.corrupt_files: list[CorruptFile] = []
        self.config: SharingConfig | None = None
        self.in_force: Candidate | None = None
        self.problem: str | None = None
        self._seen: tuple | None = None  # what the last selection looked at, for changed()
        self._listed = Listing(None, 0.0, [], None, None)  # the directory's last listing
        self.configure(file, configs_dir, default)

    def load(self) -> None:
        """Reads the persisted choice (PUT /v1/sharing/config's); a corrupt file is set aside and reported."""
        self.choice, corrupt = read_json(self._choice_path, _choice_from)
        self.corrupt_files = [corrupt] if corrupt else []

    def mps_replicas(self, inventory: Inventory) -> dict[str, int]:
        """Device UUID -> MPS replicas the config in force asks for (gpud's MPS daemons serve them)."""
        return mps_replicas(self.config, inventory)

    def configure(self, file: str, configs_dir: str | None, default: str | None) -> None:
        """Takes (re-read) settings; select() applies them."""
        self.file = Path(file)
        self.configs_dir = Path(configs_dir) if configs_dir else None
        self.default = default

    # -- the directory ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The config names in the directory, sorted: entries with a config name whose file is a regular
        file inside it, the first MAX_CONFIG_NAMES of them. The ConfigMap's own entries (..data,
        ..<timestamp>) are not configs. Listed again only when the directory changed."""
        if self.configs_dir is None:
            return []
        identity = _identity(self.configs_dir)
        if self._listed.trusted(identity):
            return self._listed.names
        listed_at = time.time()
        try:
            entries = sorted(name for name in os.listdir(self.configs_dir) if config_name_problem(name) is None)
        except OSError:
            entries = []
        problem = None
        if len(entries) > MAX_CONFIG_NAMES:
            problem = (f"{self.configs_dir} holds {len(entries)} config names, over the {MAX_CONFIG_NAMES} gpud "
                       f"reads: only the first {MAX_CONFIG_NAMES} (sorted) are configs")
            if problem != self._listed.problem:
                log.warning("sharing_configs_dir_too_many", configs_dir=str(self.configs_dir), names=len(entries),
                            limit=MAX_CONFIG_NAMES, consequence="the names after the limit are not configs")
        names = [name for name in entries[:MAX_CONFIG_NAMES] if self._inside(name)]
        first_past_cap = entries[MAX_CONFIG_NAMES] if problem else None
        self._listed = Listing(identity, listed_at, names, problem, first_past_cap)
        return names

    def _inside(self, name: str) -> bool:
        real_dir = os.path.realpath(self.configs_dir)
        real = os.path.realpath(self.configs_dir / name)
        return os.path.commonpath([real_dir, real]) == real_dir and real != real_dir and os.path.isfile(real)

    def _opener(self, name: str):
        """open()'s opener for a config's file: follows the ConfigMap's links, then refuses what is not a
        regular file inside the directory, as the kernel names the file it opened (no race with a link
        swapped between a check and the open)."""
        real_dir = os.path.realpath(self.configs_dir)

        def opener(path: str, flags: int) -> int:
            fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO cannot hang gpud
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
                if os.path.commonpath([real_dir, opened]) != real_dir:
                    raise UnsafePath(f"it leads to {opened}, outside {real_dir}: gpud reads configs inside "
                                     "sharing.configs_dir only")
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UnsafePath(f"it leads to {opened}, which is not a regular file")
            except BaseException:
                os.close(fd)
                raise
            return fd

        return opener

    def _read(self, candidate: Candidate) -> SharingConfig | None:
        """The candidate's config (None: sharing.file is absent, no sharing). Raises SharingConfigError."""
        if candidate.name is None:
            return read_sharing_file(candidate.path)
        return read_sharing_file(candidate.path, self._opener(candidate.name), missing_ok=False)

    # -- which one is in force -------------------------------------------------------------------

    def _candidates(self, names: list[str], choice: Choice | None = None) -> tuple[list[Candidate], list[str]]:
        """The files that may be in force under `choice` (default: the persisted one), best first, and what
        is wrong with the settings and the choice."""
        choice = choice or self.choice
        file = Candidate(None, self.file, "no configs_dir: sharing.file")
        if self.configs_dir is None:
            return [file], []
        candidates, problems = [], []
        chosen = choice.name if choice else None
        if chosen is not None:
            if chosen in names:
                reason = f": {choice.reason}" if choice.reason else " (no reason given)"
                candidates.append(Candidate(chosen, self.configs_dir / chosen,
                                            f"chosen through PUT /v1/sharing/config{reason}"))
            else:
                problems.append(f"the chosen config {chosen!r} is not in {self.configs_dir}; the default is used")
        if self.default is not None:
            if self.default in names:
                candidates.append(Candidate(self.default, self.configs_dir / self.default,
                                            "the default, sharing.default_config"))
            else:
                problems.append(f"sharing.default_config {self.default!r} is not in {self.configs_dir}; "
                                "sharing.file is used")
        return candidates + [file._replace(why="no chosen config nor sharing.default_config in "
                                               "configs_dir: sharing.file")], problems

    def select(self, *, at_start: bool, read: tuple[Path, SharingConfig | None] | None = None) -> None:
        """Reads the config that should be in force. At start an invalid config is reported and the next
        one tried (sharing.file last: its SharingConfigError propagates, as without configs_dir). Later
        an invalid one is reported and the config in force stays: the last good one. read: a file
        choose() has just read, and its config: not read again."""
        names = self.names()
        candidates, problems = self._candidates(names)
        if not at_start:
            candidates = candidates[:1]
        for candidate in candidates:
            try:
                config = read[1] if read and read[0] == candidate.path else self._read(candidate)
            except SharingConfigError as exc:
                if candidate.name is None and at_start:
                    raise
                stays = f"{self.in_force.path} stays in force" if self.in_force else "the next one is used"
                problems.append(f"{exc}; {stays}")
                log.error("sharing_config_invalid", name=candidate.name, path=str(candidate.path), error=str(exc),
                          consequence=stays)
                continue
            if candidate != self.in_force or config != self.config:
                log.info("sharing_config_in_force", name=candidate.name, path=str(candidate.path), why=candidate.why,
                         previous=self.in_force.name if self.in_force else None)
            self.config, self.in_force = config, candidate
            break
        if self._listed.problem:
            problems.append(self._listed.problem)
        self.problem = "; ".join(problems) or None
        self._seen = self._look(names)

    def _look(self, names: list[str]) -> tuple:
        """What select() depends on, whose change calls for it again: the names, and which file should be
        in force with its identity (a ConfigMap update swaps ..data: the file has a new inode)."""
        candidates, _ = self._candidates(names)
        return tuple(names), candidates[0], _identity(candidates[0].path)

    @property
    def available(self) -> list[str]:
        """The config names the last selection found (view() shows them: no listing on the event loop)."""
        return list(self._seen[0]) if self._seen else []

    def changed(self) -> bool:
        """Whether the directory or the file that should be in force changed since select() looked."""
        return self.configs_dir is not None and self._look(self.names()) != self._seen

    # -- choosing ----------------------------------------------------------------------------------

    def choose(self, name: str | None, reason: str | None) -> Choice:
        """Makes `name` (None: the default) the choice: checked, read and persisted before anything else
        changes, then selected (the file read once). Refusals are GpudErrors and change nothing."""
        if self.configs_dir is None:
            raise GpudError(ErrorKind.CONFLICT, "sharing-configs-dir-unset",
                            "sharing.configs_dir is not set: there are no named "
                            "configs to choose from; sharing.file is in force")
        if reason is not None and len(reason) > MAX_REASON_LENGTH:
            raise GpudError(ErrorKind.REFUSED, "sharing-config-reason-too-long",
                            f"a reason has at most {MAX_REASON_LENGTH} characters, got {len(reason)}")
        names = self.names()
        choice = Choice(name, reason, time.time())
        if name is None:  # the default, or sharing.file where the directory lacks it
            target = self._candidates(names, choice)[0][0]
        else:
            problem = config_name_problem(name)
            if problem:
                raise GpudError(ErrorKind.REFUSED, "sharing-config-name-invalid", problem)
            # an entry that is no config (a link out of the directory, a directory) is read, and refused
            if name not in names and not os.path.lexists(self.configs_dir / name):
                raise GpudError(ErrorKind.NOT_FOUND, "sharing-config-not-found",
                                f"no config {name!r} in {self.configs_dir}; "
                                f"available: {', '.join(names) or 'none'}", available=names)
            first_past_cap = self._listed.first_past_cap
            if name not in names and first_past_cap is not None and name >= first_past_cap:
                raise GpudError(ErrorKind.REFUSED, "sharing-config-past-limit",
                                f"{name!r} is not among the first {MAX_CONFIG_NAMES} config names of "
                                f"{self.configs_dir}, the ones gpud reads: {self._listed.problem}")
            target = Candidate(name, self.configs_dir / name, "")
        try:
            config = self._read(target)  # checked before it is persisted: an invalid file changes nothing
            write_json_atomic(self._choice_path, choice.document())
        except SharingConfigError as exc:
            raise GpudError(ErrorKind.REFUSED, "sharing-config-invalid", str(exc)) from None
        except OSError as exc:
            raise write_failed(self._choice_path, exc, "the sharing config choice") from None
        previous, self.choice = self.choice, choice
        log.info("sharing_config_chosen", name=name, reason=reason, file=str(target.path),
                 previous=previous.name if previous else None)
        self.select(at_start=False, read=(target.path, config))
        return choice

    def view(self) -> dict[str, Any]:
        """The `config` block of GET /v1/sharing."""
        in_force = self.in_force
        return {"name": in_force.name if in_force else None,
                "chosen": self.choice.document() if self.choice and self.choice.name else None,
                "default": self.default, "why": in_force.why if in_force else None,
                "file": str(in_force.path) if in_force else None,
                "configs_dir": str(self.configs_dir) if self.configs_dir else None,
                "available": self.available, "problem": self.problem}


def _identity(path: Path) -> tuple | None:
    """What changes when a file or directory is replaced or written: its inode, size and time."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns
