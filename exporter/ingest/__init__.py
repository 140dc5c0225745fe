"""Push API for training hooks: the Pushgateway HTTP API subset, served by the exporter itself.

    PUT    /metrics/job/stepscope/run/<run>/rank/<rank>   replace the group (200)
    POST   /metrics/job/stepscope/run/<run>/rank/<rank>   replace only the families in the body (200)
    DELETE /metrics/job/stepscope/run/<run>/rank/<rank>   drop the group (202)

Path values may be base64url-encoded Pushgateway style (`/run@base64/<b64>`). The body is a text
exposition (format 0.0.4) of only these families: stepscope_step_phase_seconds{phase} and
stepscope_step_seconds (histograms), stepscope_steps_total and stepscope_samples_total (counters),
stepscope_training_info{local_rank,world_size,pid,framework[,start_time][,pid_namespace]} (1) and
stepscope_training_state{state} (state set), stepscope_loader_limit_samples_per_second and
stepscope_compute_limit_samples_per_second (tracker.measure_limits), and the rank's latest profiler
trace: stepscope_profile_trace_bytes, _steps and _timestamp_seconds, each labelled with its `path`
(up to 4096 characters). `run` and `rank` come from the path; body labels
`run`/`rank` must match it and `job`/`instance` are refused. `_created` samples are dropped.
/metrics then shows every family once, samples of all groups merged, plus
stepscope_training_last_push_timestamp_seconds{run,rank} and the ingest self metrics. A push may carry the
step-time blocks its rank wants (`Stepscope-Bounds`), answered with the counts of the run's ranks pushing here
(`Stepscope-Run-Bounds`, exporter.ingest.node_bounds), and the profiler headers (exporter.ingest.profiles).

Flags, their defaults and STEPSCOPE_* variables: `stepscope-exporter --help` (`add_flags` below). This
module holds only them and the profile API's path: the cli parses the flags before the server's asyncio
is imported (exporter.plain_http); exporter.daemon builds the APIs from them.

Without a token or allow-list only loopback clients may push (403 otherwise); with a token every
client sends it (401 otherwise) except those in --ingest-allow-without-token, so an exporter
listening on all interfaces does not let the network inject or delete series. The same rules guard
the profile-request API (`stepscope.exporter.ingest.profile_api`, /api/v1/profiles), whose requests reach a
rank in the answer to its next push.

Refusals answer a one-line text naming the limit or the offending item and count in
stepscope_exporter_ingest_rejected_total{reason}: 401 unauthorized, 403 forbidden, 404/400 bad_path, 405
bad_method, 400 empty_body (a PUT or POST without a body, or whose body holds no sample), 408/400
incomplete_body (a body that stalls past its deadline or ends before its Content-Length), 411 length_required
(chunked body), 413 body_too_large, 415 unsupported_media_type (protobuf or compressed body), 409 run_conflict
(another process pushes the group: see below), 429 too_many_groups and too_many_series (the total over all
groups), 503 server_busy (too many body bytes in flight), and 400 for malformed, unknown_family, wrong_type,
bad_label, label_too_long, bad_value, non_cumulative_buckets, too_many_phases, too_many_series (per group) (a
malformed Stepscope-Bounds header is malformed too). A refused push changes nothing stored.

A group belongs to one process at a time, the `pid`, `start_time` and `pid_namespace` of its
stepscope_training_info: a PUT or POST whose stepscope_training_info names another process gets 409 while the
owner is live, and takes the group over (its families replacing all of the owner's, a POST's as a PUT's) once
the owner's last push said `idle` (it closed), the owner has not pushed for 2.5 of its push intervals (the
median of its last 8; at least 3 s, 12.5 s while only one push is known, at most 30 s: two thirds of the rules'
rank_lost_seconds), or the group expired or was deleted. A push without stepscope_training_info names no process
and is not checked (exporter.ingest.store).
"""

import argparse

from stepscope.contract import THRESHOLDS
from stepscope.exporter.flags import add_flag, cidr_list, positive_int, readable_file, seconds_between

MAX_TTL_SECONDS = 30 * 86400  # past a month a group is kept for no one; 1e308 overflowed the expiry's wait
RANK_LOST_FOR_SECONDS = 15  # StepscopeRankLost's `for` (grafana/rules/src/stepscope-node.rules.yml)
RANK_LOST_PAGED_SECONDS = THRESHOLDS["rank_lost_seconds"].value + RANK_LOST_FOR_SECONDS
# How long a rank that stopped pushing without closing (SIGKILL, the OOM killer) keeps its slot against a new group
# once the limits are reached: until StepscopeRankLost has paged it (45 s of silence, 15 s `for`) with four 15 s
# scrape and evaluation intervals to spare. The rules carry a paged rank on while its run is there.
LOST_GIVES_WAY_SECONDS = RANK_LOST_PAGED_SECONDS + 60
PROFILE_PREFIX = "/api/v1/profiles"  # the profile-request API (exporter.ingest.profile_api)


def add_flags(group: argparse._ArgumentGroup) -> None:
    add_flag(group, "--ingest-token-file", default=None, type=readable_file,
             help="file holding the bearer tokens pushes may send (Authorization: Bearer <token>), one per "
                  "line, newest first while rotating; re-read when it changes. Without it and without "
                  "--ingest-allow only loopback clients may push")
    add_flag(group, "--ingest-allow", default="", type=cidr_list,
             help="comma-separated networks (CIDR) whose clients may push: without a token they push "
                  "freely; with --ingest-token-file they must also send the token")
    add_flag(group, "--ingest-allow-without-token", default="", type=cidr_list,
             help="comma-separated networks (CIDR) whose clients may push without the token even when "
                  "--ingest-token-file is set (a node-local training subnet)")
    add_flag(group, "--ingest-ttl", default="600", type=seconds_between(1, MAX_TTL_SECONDS),
             help=f"seconds after its last push at which a pushed group (run, rank) is dropped, 1 to "
                  f"{MAX_TTL_SECONDS} (30 days); at {RANK_LOST_PAGED_SECONDS:g} or less a killed rank is dropped "
                  "before StepscopeRankLost pages it")
    add_flag(group, "--ingest-max-body-bytes", default="1048576", type=positive_int,
             help="largest accepted push body (413 above)")
    add_flag(group, "--ingest-max-series-per-group", default="2000", type=positive_int,
             help="most series one group (run, rank) may hold, histogram buckets included")
    add_flag(group, "--ingest-max-groups", default="512", type=positive_int,
             help="most groups (run, rank) stored at once; a closed one (state idle), then a lost one (no push "
                  f"for {LOST_GIVES_WAY_SECONDS:g} s without closing), gives way to a new group, and pushes for "
                  "new groups beyond live ones get 429")
    add_flag(group, "--ingest-max-label-value-length", default="128", type=positive_int,
             help="longest label value (and run name) accepted, in characters")
    add_flag(group, "--ingest-max-phases", default="32", type=positive_int,
             help="most distinct phase names per group; a push with more is refused whole (400): raise the "
                  "hooks' max_phases only as far as this")
    add_flag(group, "--ingest-max-series", default="150000", type=positive_int,
             help="most series stored over all groups (429 above, once closed groups gave way); bounds the "
                  "exporter's memory")
    add_flag(group, "--ingest-max-bytes-in-flight", default="8388608", type=positive_int,
             help="most push-body bytes received at once, by Content-Length; a push beyond it gets 503 "
                  "before its body is read, so pushes never crowd out scrapes")



def short_ttl_warning(ttl_seconds: float) -> str | None:
    """The line to log when --ingest-ttl drops a killed rank before StepscopeRankLost can page it; None otherwise.

    The alert pages a rank its exporter shows without a push for rank_lost_seconds, for RANK_LOST_FOR_SECONDS; a
    group a healthy exporter dropped is, by design, no longer lost (it may have been deleted). With --ingest-ttl 20,
    2 ranks SIGKILLed were never paged in 4 minutes of a real Prometheus running the shipped rules, and nothing said
    why. A TTL that short is legitimate (tests, a node that must forget fast), so it is said once, not refused."""
    if ttl_seconds > RANK_LOST_PAGED_SECONDS:
        return None
    return (f"--ingest-ttl {ttl_seconds:g} drops a rank that stops pushing without closing (SIGKILL, the OOM killer) "
            f"before StepscopeRankLost can page it (no push for {THRESHOLDS['rank_lost_seconds'].value:g} s, for "
            f"{RANK_LOST_FOR_SECONDS} s): killed ranks go unalerted; use more than {RANK_LOST_PAGED_SECONDS:g} s "
            "(the default is 600)")
