"""Per-step metrics: one JSON line per record in `RUN_DIR/metrics.jsonl`, optionally TensorBoard too."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends records to metrics.jsonl (flushed each line, so a crash loses at most the line being written)."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, resume_after: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_after is not None:
            self._truncate_after(resume_after)
        self._file = open(self.path, "a")
        self._tb = _tensorboard_writer(run_dir) if tensorboard else None

    def _truncate_after(self, step: int) -> None:
        """Drops the records of steps after `step`: a resumed run writes them again."""
        keep = [line for line in read_metrics(self.path) if line.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "`--tensorboard` needs the tensorboard package: pip install 'memo-train[tensorboard]'"
        ) from None
    return SummaryWriter(str(Path(run_dir) / "tensorboard"))


def read_metrics(path: Path) -> list[dict]:
    """Returns the records of a metrics.jsonl; lines that are not a record (a torn last line from a crash, an
    edit, a foreign line) are skipped and named in a warning, never a crash."""
    if not Path(path).exists():
        return []
    records, skipped = [], []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif line.strip():
            skipped.append(str(number))
    if skipped:
        log.warning("%s: skipped line(s) %s, not metrics records", path, ", ".join(skipped[:10]))
    return records
