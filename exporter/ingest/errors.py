"""The one way a push is refused: an HTTP status, a counter reason and a message for the pusher."""

# Every reason `stepscope_exporter_ingest_rejected_total` can carry; all are published from start-up
# (at 0) so alerts on a rate work before the first rejection.
REASONS = (
    "bad_label",
    "bad_method",
    "bad_path",
    "bad_value",
    "body_too_large",
    "empty_body",
    "forbidden",
    "incomplete_body",
    "label_too_long",
    "length_required",
    "malformed",
    "non_cumulative_buckets",
    "run_conflict",
    "server_busy",
    "too_many_groups",
    "too_many_phases",
    "too_many_series",
    "unauthorized",
    "unknown_family",
    "unsupported_media_type",
    "wrong_type",
)


class Rejected(Exception):
    """A push the exporter refuses; raised before anything stored changes."""

    def __init__(self, status: int, reason: str, message: str, subject: str = "") -> None:
        """`subject` tells refusals of one reason apart for the log: each new one is a warning (a run_conflict
        names its run, rank and process, so a clash that starts later is not lost among the first's repeats)."""
        assert reason in REASONS, reason
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.subject = subject


def clip(text: str, limit: int = 80) -> str:
    """Shortens client-supplied text quoted back in a refusal or a log line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
