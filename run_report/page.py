"""index.html: one self-contained page (styles inline, pictures as data: URIs, no script, nothing
fetched), so it opens from disk, attaches to a ticket and survives being mailed around.

Order: the verdict in words with its numbers and fix, the key numbers, the pictures, the tables.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING

from stepscope.contract import LOCAL_PHASES, STATES, TRAIN_STATE, verdicts
from stepscope.contract.goodput import LOST
from stepscope.contract.recordings import RUN_VERDICT
from stepscope.report import fmt, mfu
from stepscope.report.csvs import cell
from stepscope.report.resize import Resize, ended_with_the_job, ranks_words
from stepscope.report.summary import STRAGGLER_SCORE, MissingRanks, missing_ranks
from stepscope.report.timeline import LOST_SECONDS, Interval, losses, rank_key
from stepscope.report.times import clock, iso
from stepscope.report.window import Window

if TYPE_CHECKING:
    from stepscope.report.report import Report

GENERATOR = "stepscope-report"
LOCAL_PHASES_HTML = " + ".join(f"<code>{phase}</code>" for phase in LOCAL_PHASES)

VERDICT_BORDERS = {verdicts.DATA_BOUND: "#c62828", verdicts.GPU_BOUND: "#2e7d32", verdicts.GPU_BUSY_IDLE: "#ef6c00",
                   verdicts.HOST_BOUND: "#f9a825",
                   verdicts.GPU_SHARED: "#8d6e63", verdicts.UNDETERMINED: "#5c6bc0", verdicts.IDLE: "#9e9e9e"}
STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1120px;
padding:0 16px 48px;color:#212121}
h1{margin:24px 0 4px}h2{margin:28px 0 8px;border-bottom:1px solid #e0e0e0;padding-bottom:4px}
.meta{color:#616161;margin:0}
.verdict{border-left:6px solid #9e9e9e;background:#fafafa;padding:4px 18px 12px;margin-top:18px}
.verdict h2{border:0;margin-top:12px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #e0e0e0;padding:3px 8px;text-align:right}
th{background:#f5f5f5}td.text,th.text{text-align:left}
.ok{color:#2e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}.na{color:#757575}
.wide{overflow-x:auto}
img{display:block;max-width:100%;height:auto;margin:8px 0}
.note{color:#616161;font-size:13px}
.lost{color:#b71c1c}
code{background:#f5f5f5;padding:0 3px}
""" + "".join(f".v-{verdict}{{border-color:{color}}}" for verdict, color in VERDICT_BORDERS.items())


def render(report: Report, images: Mapping[str, tuple[str, bytes | str]], files: Sequence[str]) -> str:
    """The page. `images`: section title -> (alt text, PNG bytes, or a sentence when there is no data)."""
    a = report.assessment
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta name="generator" content="{GENERATOR}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>stepscope report: {escape(report.data.run)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Run {escape(report.data.run)}</h1>",
        f'<p class="meta">{escape(_window_words(report))}</p>',
        f'<p class="goodput"><strong>{escape(report.goodput.headline())}</strong>{escape(_energy_words(report))}</p>',
        *_resize_words(report),
        *_lost_words(report),
        f'<section class="verdict v-{escape(a.verdict)}"><h2>{escape(a.headline)}</h2>',
        f"<p>{escape(a.because)}</p>",
        *([f'<p class="note">Rule for <code>{escape(a.verdict)}</code>: {escape(a.rule)}.</p>'] if a.rule else []),
        "<p><strong>What to try</strong></p><ul>",
        *(f"<li>{escape(fix)}</li>" for fix in a.fixes),
        "</ul>",
        _table(("rule of thumb", "measured", "target", ""),
               [(c.rule, c.measured, c.target, _mark(c.ok)) for c in a.checks], text_columns=3),
        f'<p class="note">Verdict over the window (rule <code>{RUN_VERDICT}</code>): '
        f"{escape(_fractions(a.fractions))}.{escape(_periods(a.periods, report.data.window))}</p></section>",
        "<h2>Key numbers</h2>",
        _table(("", "value"), _key_numbers(report), text_columns=1),
    ]
    for title, (alt, image) in images.items():
        parts.append(f"<h2>{escape(title)}</h2>")
        if isinstance(image, bytes):
            encoded = base64.b64encode(image).decode("ascii")
            parts.append(f'<img alt="{escape(alt)}" src="data:image/png;base64,{encoded}">')
        else:
            parts.append(f'<p class="note">{escape(image)}</p>')
    parts += [
        "<h2>Ranks</h2>",
        '<p class="note">Over the whole window. Phase columns are shares of step time; scores are the run\'s '
        "typical value over the rank's (the median rank's; of two, the faster one's) "
        f"(1 typical, below {STRAGGLER_SCORE:g} a straggler): of mean step time, and "
        f"of the local phases before the first collective ({LOCAL_PHASES_HTML}).</p>",
        _rank_table(report),
        *_allocator_section(report),
        "<h2>Time per state</h2>",
        '<p class="note">Seconds each rank spent in each state over the window, as its hooks count them: every '
        "eval and checkpoint is in, however short (the Gantt chart above samples the state at each scrape). "
        f"The {TRAIN_STATE} share is the rank's time spent training.</p>",
        _state_table(report),
        "<h2>Nodes</h2>",
        _node_table(report),
        "<h2>Files</h2><ul>",
        *(f'<li><a href="{escape(name)}">{escape(name)}</a></li>' for name in files),
        "</ul>",
        f'<p class="note">Generated by {GENERATOR} at {escape(iso(report.generated))} from '
        f"{escape(report.prometheus_url)}; resolution {report.data.window.step:g} s.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _window_words(report: Report) -> str:
    window = report.data.window
    ranks = len({rank.rank for rank in report.ranks})
    nodes = ", ".join(report.data.nodes) or "no node"
    return (f"{iso(window.start)} to {iso(window.end)} ({fmt.duration(window.seconds)}), "
            f"{ranks} rank{'s' * (ranks != 1)} on {nodes}{_resized_words(report.resizes)}"
            f"{_missing_words(missing_ranks(report.data))}")


def _resized_words(resizes: Sequence[Resize]) -> str:
    """What the header adds for a run that went on with another world size: its ranks counted over the window
    read as one world size otherwise (`4 ranks` for a run of 4 ranks, then 2)."""
    if not resizes:
        return ""
    sizes = ", then ".join(f"to {resize.after} at {iso(resize.at)}" for resize in resizes)
    return f", resized from world size {resizes[0].before} {sizes}"


def _missing_words(missing: MissingRanks | None) -> str:
    """What the header adds when ranks of the world size never reported: the numbers are the others'."""
    if missing is None:
        return ""
    return (f"; {missing.words}, and every number here leaves {'it' if missing.count == 1 else 'them'} out (is "
            "the exporter of each node scraped by this Prometheus?)")


def _key_numbers(report: Report) -> list[tuple[str, str]]:
    totals, gpus = report.totals, report.assessment.gpus
    return [
        ("steps (all ranks)", fmt.count(totals.steps)),
        ("samples (all ranks)", fmt.count(totals.samples)),
        *_warm_up_numbers(report),
        ("mean step time", fmt.seconds(totals.mean)),
        ("step time p50 / p95 (run)", f"{fmt.seconds(totals.p50)} / {fmt.seconds(totals.p95)}"),
        ("data-loading share of step time", fmt.percent(totals.dataloader_share)),
        ("NVML GPU utilization while training (busy or waiting)", fmt.percent(gpus.nvml)),
        ("SM active while training (GPM: how well busy GPUs are used)", fmt.activity(gpus.sm_active)),
        ("tensor-core activity while training (GPM)", fmt.activity(gpus.tensor_active)),
        ("effective GPU utilization while training", fmt.percent(gpus.effective)
         + (f" ({gpus.source})" if gpus.source else "")),
        *_throughput_numbers(report),
    ]


def _warm_up_numbers(report: Report) -> list[tuple[str, str]]:
    """The longest first step left out as a warm-up (summary.WARM_UP_FACTOR), and the longest of a process that
    restarted in the window (a requeue compiles again), said where the numbers start: without it a reader would
    take the steady numbers below for the whole run's."""
    warmed = [(rank.rank, warm_up) for rank in report.ranks for warm_up in rank.warm_ups]
    if not warmed:
        return []
    several_ranks = len(report.ranks) > 1
    said = []
    for after_restart in (False, True):
        these = [(rank, warm_up) for rank, warm_up in warmed if warm_up.after_restart == after_restart]
        if not these:
            continue
        rank, longest = max(these, key=lambda pair: pair[1].first_step_seconds)
        on = f" on rank {rank}" if several_ranks else ""
        restart = (" after a restart" + (f" (the longest of {len(these)})" if len(these) > 1 else "")
                   if after_restart else "")
        said.append(f"{fmt.seconds(longest.first_step_seconds)}{on}{restart}")
    left_out = fmt.count(sum(warm_up.steps for _, warm_up in warmed))
    return [("first step (warm-up)",
             f"first step{'s' if len(said) > 1 else ''} {' and '.join(said)} (warm-up: compilation, cudnn benchmark, "
             f"data-loader start-up), left out of the step time, phase shares and sample rates below with the "
             f"steps up to the first scrape of them ({left_out} of {fmt.count(report.totals.steps)}); the counts "
             f"stay whole")]


def _throughput_numbers(report: Report) -> list[tuple[str, str]]:
    """Tokens and MFU (docs/mfu.md), where the run counts them."""
    done = report.assessment.throughput
    if done is None or (done.tokens is None and done.model_flops is None):
        return []
    return [
        ("tokens (all ranks)", fmt.count(done.tokens)),
        ("tokens per second while training", fmt.count(done.tokens_per_second)),
        ("model FLOP/s achieved while training", mfu.flops_per_second(done.flops_per_second)),
        ("MFU while training (model FLOP/s over the GPUs' dense peak of "
         f"{mfu.flops_per_second(done.peak_flops)})", mfu.mfu_percent(done.mfu)),
    ]


class Markup(str):
    """A table cell that is already HTML (a coloured mark), not text to escape."""


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], text_columns: int = 0) -> str:
    def css(index: int) -> str:
        return ' class="text"' if index < text_columns else ""

    def content(value: object) -> str:
        return value if isinstance(value, Markup) else escape(_display(value))

    head = "".join(f"<th{css(i)}>{escape(h)}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td{css(i)}>{content(v)}</td>" for i, v in enumerate(row)) + "</tr>"
                   for row in rows)
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _rank_table(report: Report) -> str:
    phases = report.totals.phases
    header = ["rank", "node", "steps", "samples", "mean step", "p50", "p95", *phases, "in no phase",
              "step-time score", "local score"]
    rows = [
        [rank.rank, rank.node, fmt.count(rank.steps), fmt.count(rank.samples), fmt.seconds(rank.mean),
         fmt.seconds(rank.p50), fmt.seconds(rank.p95), *(fmt.percent(rank.share(phase)) for phase in phases),
         fmt.percent(rank.untimed_share), _score(rank.step_time_score), _score(rank.local_score)]
        for rank in report.ranks
    ]
    return _table(header, rows, text_columns=2)


def _allocator_section(report: Report) -> list[str]:
    """PyTorch's caching allocator per rank, where ranks on CUDA pushed it; nothing for a CPU run."""
    ranks = [rank for rank in report.ranks if rank.cuda is not None]
    if not ranks:
        return []
    header = ["rank", "node", "peak allocated", "most reserved", "allocation retries", "OOMs"]
    rows = [[rank.rank, rank.node, fmt.gibibytes(rank.cuda.peak_bytes), fmt.gibibytes(rank.cuda.reserved_bytes),
             fmt.count(rank.cuda.alloc_retries), fmt.count(rank.cuda.ooms)] for rank in ranks]
    return ["<h2>GPU memory (PyTorch's allocator)</h2>",
            '<p class="note">Each rank\'s caching allocator over the window: the most given to tensors at once and '
            "the most held from the GPU (reserved far above allocated is a cache, not pressure). Allocation retries "
            "flush the cache and synchronize the GPU: steps slow down before an OOM "
            "(StepscopeCudaAllocRetries).</p>",
            _table(header, rows, text_columns=2)]


def _state_table(report: Report) -> str:
    header = ["rank", "node", *STATES, f"{TRAIN_STATE} share"]
    rows = [
        [rank.rank, rank.node, *(fmt.seconds(rank.state_seconds.get(state)) for state in STATES),
         fmt.percent(rank.train_time_share)]
        for rank in report.ranks
    ]
    return _table(header, rows, text_columns=2)


def _node_table(report: Report) -> str:
    header = ["node", "ranks", "steps", "samples", "mean step", "fastest rank's mean", "slowest rank's mean",
              "skew (slowest / fastest)"]
    rows = [
        [node.node, node.ranks, fmt.count(node.steps), fmt.count(node.samples), fmt.seconds(node.mean),
         fmt.seconds(node.fastest_rank_mean), fmt.seconds(node.slowest_rank_mean),
         "" if node.skew is None else f"{node.skew:.3f}"]
        for node in report.nodes
    ]
    return _table(header, rows, text_columns=1)


def _score(value: float | None) -> Markup:
    css = "bad" if value is not None and value < STRAGGLER_SCORE else "plain"
    return Markup(f'<span class="{css}">{escape(fmt.score(value))}</span>')


def _display(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if not value.is_integer() else f"{int(value):,}"
    return cell(value)


def _mark(ok: bool | None) -> Markup:
    if ok is None:
        return Markup('<span class="na">n/a</span>')
    return Markup('<span class="ok">pass</span>' if ok else '<span class="bad">fail</span>')


def _fractions(fractions: Mapping[str, float]) -> str:
    def share_text(share: float) -> str:
        return "<1%" if share < 0.005 else f"{share:.0%}"

    return ", ".join(f"{verdict} {share_text(share)}" for verdict, share in fractions.items()) or "no verdict recorded"


def _periods(periods: Sequence[tuple[str, float, float]], window: Window) -> str:
    """" In order: host_bound from 17:57:43 UTC for 2m 25s, then data_bound from 18:00:08 UTC for 1m 58s", where
    the verdict changed: which came last is what the run needs now (with the date where the window spans days)."""
    if len(periods) < 2:
        return ""
    spans = (f"{verdict} from {clock(start, window.start, window.end)} UTC for {fmt.duration(end - start)}"
             for verdict, start, end in periods)
    return " In order: " + ", then ".join(spans) + "."


def _energy_words(report: Report) -> str:
    """The run's GPU energy after the goodput headline: kWh and joules per sample, where the run had GPUs."""
    g = report.goodput
    if not g.energy_joules:
        return ""
    per_sample = f", {g.joules_per_sample:.3g} J per sample" if g.joules_per_sample is not None else ""
    per_token = f", {g.joules_per_token:.3g} J per token" if g.joules_per_token is not None else ""
    return f"; GPU energy {g.kwh:.3g} kWh{per_sample}{per_token}"


def _resize_words(report: Report) -> list[str]:
    """A line per resize: the world size the run went on with, from when, and the ranks that ended or joined there.
    Ranks that ended with the job that was resized (killed whole, requeued smaller) are said here, not as lost."""
    return [f'<p class="resize"><strong>Resized at {escape(iso(resize.at))}</strong>: the run went on with world '
            f"size {resize.after}, where it had {resize.before}; {escape(_ended_or_joined(resize, report.intervals))}."
            "</p>" for resize in report.resizes]


def _ended_or_joined(resize: Resize, intervals: Sequence[Interval]) -> str:
    if resize.joined:
        return f"{ranks_words(resize.joined)} joined there"
    ended = ranks_words(resize.ended)
    with_the_job = ended_with_the_job(resize, intervals)
    if not with_the_job:
        return f"{ended} ended there"
    which = {int(i.rank) for i in with_the_job}
    whose = "" if which == set(resize.ended) else f" ({ranks_words(which)})"
    return (f"{ended} ended there, with the job that stopped at {iso(max(i.start for i in with_the_job))}{whose}: "
            "their last push; the Gantt chart and state_timeline.csv show them lost from it to the resize")


def _lost_words(report: Report) -> list[str]:
    """A line per loss: the exporter kept the ranks' last state, so the page says where they really stopped, and
    where new processes of them pushed again (a requeue, a restart from a checkpoint), from when. Ranks lost
    together (their last pushes within LOST_SECONDS of each other: a job killed whole, a node gone) that ended
    alike are one line; every loss of a rank is said, not only its first. Before, each rank had a line of its own
    and only for its first loss: a 256-rank job killed and requeued put 256 lines above the verdict, and the node
    whose 8 ranks were lost for good an hour later was named nowhere. A rank that ended with its job at a resize is
    the resize's line's."""
    with_a_job = {(i.rank, i.node, i.start) for resize in report.resizes
                  for i in ended_with_the_job(resize, report.intervals)}
    lost = [i for i in losses(report.intervals) if (i.rank, i.node, i.start) not in with_a_job]
    return [_loss_line(group, report) for group in _lost_together(lost, report)]


def _lost_together(lost: Sequence[Interval], report: Report) -> list[list[Interval]]:
    """`lost` (in time order) in groups whose last pushes lie within LOST_SECONDS of the group's first and that
    ended alike: pushed again, or ended at the same resize, or neither."""
    groups: list[list[Interval]] = []
    for cluster in _clustered(lost):
        by_ending: dict[object, list[Interval]] = {}
        for interval in cluster:
            resize = _resize_ending(report.resizes, interval)
            came_back = _back(report.intervals, interval) is not None
            by_ending.setdefault(True if came_back else resize.at if resize else None, []).append(interval)
        groups += by_ending.values()
    return groups


def _clustered(lost: Sequence[Interval]) -> list[list[Interval]]:
    clusters: list[list[Interval]] = []
    for interval in lost:
        if clusters and interval.start - clusters[-1][0].start <= LOST_SECONDS:
            clusters[-1].append(interval)
        else:
            clusters.append([interval])
    return clusters


def _loss_line(group: Sequence[Interval], report: Report) -> str:
    one = len(group) == 1
    who = f"Rank {group[0].rank} on {group[0].node}" if one else _ranks_on_nodes(group)
    pushes = sorted(i.start for i in group)
    at = f"at {iso(pushes[0])}" if pushes[0] == pushes[-1] else f"between {iso(pushes[0])} and {iso(pushes[-1])}"
    return (f'<p class="lost"><strong>{escape(who)} lost</strong>: last push {escape(at)}, then none for more than '
            f"{LOST_SECONDS:g} s without closing (as StepscopeRankLost fires); the Gantt chart and state_timeline.csv "
            f"show {'it' if one else 'them'} as lost from there{escape(_ending_words(group, report))}.</p>")


def _ranks_on_nodes(group: Sequence[Interval]) -> str:
    """`Ranks 0-255 on 32 nodes`, `Ranks 248-255 on n31`: the nodes named up to four."""
    ranks = sorted({i.rank for i in group}, key=rank_key)
    named = ranks_words(map(int, ranks)).capitalize() if all(map(str.isdigit, ranks)) else f"Ranks {', '.join(ranks)}"
    nodes = sorted({i.node for i in group})
    return f"{named} on {', '.join(nodes) if len(nodes) <= 4 else f'{len(nodes)} nodes'}"


def _ending_words(group: Sequence[Interval], report: Report) -> str:
    """Where the group's ranks were seen again (a restarted process, or pushes that landed late) or ended at a later
    resize (a node gone, the job requeued without them): a line that said only "lost from there" read as the rank
    gone for good while a restarted process of it trained for another hour."""
    one = len(group) == 1
    backs = sorted(back for i in group if (back := _back(report.intervals, i)) is not None)
    if backs:
        if one:
            return f" until {iso(backs[0])}, when the rank pushed again"
        if backs[0] == backs[-1]:
            return f" until {iso(backs[0])}, when they pushed again"
        return f" until they pushed again, between {iso(backs[0])} and {iso(backs[-1])}"
    resize = _resize_ending(report.resizes, group[0])
    return "" if resize is None else (f" until {iso(resize.at)}, when the run went on with world size {resize.after} "
                                      f"without {'it' if one else 'them'}")


def _resize_ending(resizes: Sequence[Resize], lost: Interval) -> Resize | None:
    """The later resize where the lost rank ended."""
    return next((resize for resize in resizes if resize.ends(lost.rank) and resize.at >= lost.start), None)


def _back(intervals: Sequence[Interval], lost: Interval) -> float | None:
    """When the lost rank (on any node) is first seen in a state of its own again after it was lost."""
    return min((i.start for i in intervals if i.rank == lost.rank and i.state != LOST and i.start > lost.start),
               default=None)
