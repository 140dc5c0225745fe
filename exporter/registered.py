"""The training processes the hooks registered, as the ingest store hands them to the process collector.

Keeps the collector ignorant of pushed families and the ingest ignorant of /proc.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class RegisteredProcess:
    """One `stepscope_training_info` sample of a live group.

    `pid` is os.getpid() in the training process's own pid namespace, which in a container is not the
    pid the exporter sees; `start_time` (Unix seconds, None from clients that do not send it) lets the
    process collector tell the two apart and find the process the exporter sees; `pid_namespace` (the
    inode of its pid namespace, None from clients that do not send it) tells apart two pods' processes
    with the same pid that started in the same clock tick. `pushed_at` (Unix
    seconds of the group's last push) picks the run a process works for now when it appears in several
    live groups: a notebook or an in-process sweep that closed one run and opened the next keeps its
    pid, and the closed run's group lives on until its TTL.
    """

    pid: int
    run: str
    rank: str
    start_time: float | None = None
    pushed_at: float = 0.0
    pid_namespace: int | None = None

    @property
    def reported(self) -> tuple[int, float | None, int | None]:
        """What the process said of itself to be found here: (pid, start_time, pid_namespace)."""
        return self.pid, self.start_time, self.pid_namespace
