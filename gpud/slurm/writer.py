"""Keeps Slurm's gres.conf current (slurm.gres_file), as the CDI spec is kept (gpud.kept_writer): rebuilt
after every inventory, MIG, MPS or sharing change, written by a rename only when it changed, a file
changed behind gpud's back rewritten. Without slurm.gres_file the text is only built, for the API and CLI.

With slurm.reconfigure, each write that changed the file is followed by `scontrol reconfigure`, which
makes slurmd re-read gres.conf (gres.conf(5): changes take effect upon "scontrol reconfigure" unless
otherwise noted). A failing scontrol is reported, never fatal: the file is written all the same."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpud.base import child
from gpud.base.hostfile import PROC_LIST_BYTES, read_host_text
from gpud.base.logs import get_logger
from gpud.base.safefs import KeptFile
from gpud.cdi.spec import parse_mig_minors
from gpud.events import EventBus
from gpud.inventory import InventoryService
from gpud.kept_writer import KeptFileWriter
from gpud.model.inventory import Inventory
from gpud.sharing.service import SharingView
from gpud.slurm.cores import CoreIndex
from gpud.slurm.gres import Gres, build_gres

log = get_logger("slurm")
OUTPUT_LIMIT = 4096  # characters of scontrol's output kept for the view: enough for its error message
OUTPUT_CAP = 64 * 1024  # bytes of it read at most: scontrol reconfigure prints a line or two


class GresWriter(KeptFileWriter):
    name = "slurm-gres"
    event = "slurm_gres"
    setting = "slurm.gres_file"
    rewrite_why = "slurmd reads its GPUs from it: only what gpud knows of them may be there"
    not_written_consequence = "slurmd keeps the previous gres.conf, if any"

    def __init__(self, path: Path | None, mig_minors_path: Path, sysfs: Path, inventory: InventoryService,
                 sharing: SharingView, bus: EventBus, *, reconfigure: bool = False, scontrol: str = "scontrol",
                 reconfigure_timeout_s: float = 30.0):
        # 0644: slurmd and the Slurm commands read it as other users (SlurmUser)
        super().__init__(path, 0o644, inventory, bus, log)
        self._mig_minors_path = mig_minors_path
        self._cores = CoreIndex(sysfs)
        self._sharing = sharing
        self.gres: Gres | None = None  # what the file holds (the view)
        self._built: Gres | None = None
        self.reconfigure_enabled = reconfigure
        self._scontrol = scontrol
        self._reconfigure_timeout_s = reconfigure_timeout_s
        self.last_reconfigure: dict | None = None  # {"at", "argv", "returncode", "output"} of the last run
        self._reconfigure_wanted = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def view(self) -> dict:
        """GET /v1/slurm/gres: what the file holds, or what could not be written (error says why)."""
        gres = self._built if self.error else self.gres
        return {"path": str(self.path) if self.path else None, "text": gres.text if gres else None,
                "node_gres": gres.node_gres if gres else None, "records": gres.records if gres else [],
                "unavailable": gres.unavailable if gres else [], "written_at": self.written_at,
                "error": self.error, "changed_behind_gpud": self.changed_behind_gpud,
                "reconfigure": {"enabled": self.reconfigure_enabled, "last": self.last_reconfigure}}

    def build(self, inventory: Inventory) -> str:
        try:
            minors = parse_mig_minors(read_host_text(self._mig_minors_path, PROC_LIST_BYTES))
        except OSError:
            minors = {}  # no table: a host without MIG support, as gpud's CDI spec reads it
        # shown (view) once written: a build runs on a thread, and the view and the file agree
        self._built = build_gres(inventory, self._sharing.document, minors, self._cores)
        return self._built.text

    def write(self, file: KeptFile, text: str) -> None:
        file.write(text.encode())

    def written(self, text: str, reason: str) -> None:
        gres = self.gres = self._built
        log.info("slurm_gres_built" if self.path is None else "slurm_gres_written",
                 path=None if self.path is None else str(self.path),
                 reason=reason, node_gres=gres.node_gres, records=len(gres.records), unavailable=len(gres.unavailable))
        if self.path is not None and self.reconfigure_enabled and self._loop is not None:
            self._loop.call_soon_threadsafe(self._reconfigure_wanted.set)  # written() runs on a thread

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        reconfigurer = asyncio.create_task(self._reconfigure_after_writes(), name="slurm-reconfigure")
        try:
            await super().run()
        finally:
            reconfigurer.cancel()
            await asyncio.gather(reconfigurer, return_exceptions=True)

    async def _reconfigure_after_writes(self) -> None:
        """One scontrol at a time; writes made while it runs are followed by one more."""
        while True:
            await self._reconfigure_wanted.wait()
            self._reconfigure_wanted.clear()
            await self.reconfigure()

    async def reconfigure(self) -> dict:
        """Runs `<slurm.scontrol> reconfigure`, records and logs how it went; never raises."""
        argv = [self._scontrol, "reconfigure"]
        started = time.time()
        try:
            run = await child.run(argv, timeout_s=self._reconfigure_timeout_s, output_cap=OUTPUT_CAP,
                                  merge_stderr=True)
        except OSError as exc:
            returncode, output = None, f"cannot run {self._scontrol}: {exc.strerror or exc}"
        else:
            returncode, output = run.exit_code, run.text(OUTPUT_LIMIT)
            why = run.failure(self._reconfigure_timeout_s, OUTPUT_CAP)
            if why:
                output = f"{why} (slurm.reconfigure_timeout_s {self._reconfigure_timeout_s:g} s): {output}"
        self.last_reconfigure = {"at": started, "argv": argv, "returncode": returncode, "output": output}
        if returncode == 0:
            log.info("slurm_reconfigured", argv=argv, path=str(self.path))
        else:
            log.error("slurm_reconfigure_failed", argv=argv, returncode=returncode, output=output,
                      consequence="slurmd reads the new gres.conf at its next reconfigure or restart")
        return self.last_reconfigure
