"""Sleep mode (vLLM's --enable-sleep-mode): the worker gives its weights' and KV cache's memory
back between training steps of an RL loop, and takes them up again on wake-up.

- Level 1: the weights go, and the checkpoint files they were built from are first copied
  into anonymous memory files (memfd): host memory outside this process's RSS, which wake-up
  builds the model from at memory speed, whatever becomes of the checkpoint directory.
- Level 2: the weights go with no copy: wake-up builds the model from the checkpoint
  directory again.
- Both drop the KV cache's contents and give its memory back (kv_cache.release_kv_caches);
  its tensors stay, so nothing that holds a view of them has to change.

NOTE: on CPU the weights are prepacked for the GEMM at load (models/layers.py), in layouts
only the loader makes, so they are not copied out and back as bytes: wake-up runs the loader.
The scheduler sends no step while its worker sleeps; everything here runs in the step thread.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch

from services.worker.kv.kv_cache import release_kv_caches, restore_kv_caches
from services.worker.runner.model_runner import ModelRunner

log = structlog.get_logger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")   # vLLM's wake_up tags
SLEEP_LEVELS = (1, 2)


class SleepModeError(ValueError):
    """A sleep or wake-up the worker refuses (a bad level or tag)."""


class CheckpointBackup:
    """A checkpoint directory whose weight files (*.safetensors) are copies in memfds, the
    other files links to the originals: a directory the model loader reads like the first."""

    def __init__(self, model_dir: Path):
        self._dir = tempfile.TemporaryDirectory(prefix="llm-mesh-sleep-")
        self.model_dir = Path(self._dir.name)
        self._fds: list[int] = []
        try:
            for path in model_dir.iterdir():
                link = self.model_dir / path.name
                if path.suffix == ".safetensors":
                    link.symlink_to(f"/proc/{os.getpid()}/fd/{self._copy_to_memfd(path)}")
                else:
                    link.symlink_to(path.resolve())
        except BaseException:
            self.close()
            raise

    @property
    def num_bytes(self) -> int:
        return sum(os.fstat(fd).st_size for fd in self._fds)

    def _copy_to_memfd(self, path: Path) -> int:
        fd = os.memfd_create(path.name, os.MFD_CLOEXEC)
        self._fds.append(fd)
        with path.open("rb") as source:
            size = os.fstat(source.fileno()).st_size
            offset = 0
            while offset < size:   # in the kernel: the bytes never pass through this process
                offset += os.sendfile(fd, source.fileno(), offset, size - offset)
        return fd

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._dir.cleanup()


class SleepMode:
    """What a worker has released, and the way back (vLLM's Worker.sleep / wake_up)."""

    def __init__(self, runner: ModelRunner):
        self._runner = runner
        self._backup: CheckpointBackup | None = None
        self.sleeping: set[str] = set()   # SLEEP_TAGS released now

    def sleep(self, level: int) -> float:
        """Releases the weights and the KV cache; returns the seconds it took. Sleeping again
        releases what a partial wake-up restored (level 2 also drops a level-1 copy)."""
        if level not in SLEEP_LEVELS:
            raise SleepModeError(f"sleep level must be 1 or 2, not {level}")
        started = time.perf_counter()
        runner = self._runner
        if "weights" not in self.sleeping:
            if level == 1:
                self._backup = CheckpointBackup(runner.config.model_dir)
            runner.release_model()
        elif level == 2:
            self._drop_backup()
        if "kv_cache" not in self.sleeping:
            release_kv_caches(runner.kv_caches)
        self.sleeping = set(SLEEP_TAGS)
        _give_memory_back(runner.device)
        seconds = time.perf_counter() - started
        log.info("asleep", level=level, seconds=round(seconds, 2),
                 backup_bytes=self._backup.num_bytes if self._backup else 0)
        return seconds

    def wake_up(self, tags: Iterable[str] = ()) -> float:
        """Restores what `tags` name (none: everything); returns the seconds it took."""
        wanted = set(tags) or set(SLEEP_TAGS)
        if unknown := wanted - set(SLEEP_TAGS):
            raise SleepModeError(f"unknown wake_up tags {sorted(unknown)} (choose from "
                                 f"{', '.join(SLEEP_TAGS)})")
        started = time.perf_counter()
        runner = self._runner
        if "weights" in wanted & self.sleeping:
            source = self._backup.model_dir if self._backup else runner.config.model_dir
            runner.load_model(source)
            self._drop_backup()
            self.sleeping.discard("weights")
        if "kv_cache" in wanted & self.sleeping:
            restore_kv_caches(runner.kv_caches, runner.kv_spec, runner.info.num_blocks)
            self.sleeping.discard("kv_cache")
        seconds = time.perf_counter() - started
        log.info("woken up", tags=sorted(wanted), still_sleeping=sorted(self.sleeping),
                 seconds=round(seconds, 2))
        return seconds

    def _drop_backup(self) -> None:
        if self._backup is not None:
            self._backup.close()
            self._backup = None


def _give_memory_back(device: torch.device) -> None:
    """Frees what the dropped objects held, all the way to the OS: glibc keeps freed heap
    memory in its arenas (smaller tensors come from there) until malloc_trim."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: its allocator decides
        pass
