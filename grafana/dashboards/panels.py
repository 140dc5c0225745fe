"""Panel and variable builders shared by the dashboards, so every panel gets the same basics.

Every panel goes through `_panel`, which sets the `${datasource}` data source, a description, the unit
and the queries; the tests check that nothing slips past it.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prom_models
from grafana_foundation_sdk.models.common import DataSourceRef

from stepscope.contract import recordings as rec

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SAMPLES_PER_SECOND = "suffix: samples/s"
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# A bar gauge of table rows ("All values") draws 25 rows unless told otherwise: the Cluster dashboard's 64 nodes,
# `all` drawn, lost the 39 busiest, and 20 ranks drawn with a bar per score (40 rows) their 15 highest. As many as a
# dashboard's `all` may ask, so the bars drawn are the rows the query returns.
BARS_AT_MOST = 1_000_000
TAG = "stepscope"  # every stepscope dashboard's tag: the link set on each lists the others by it
# Joins a time a node stamped (a rank's last push, an XID) to that node's clock offset, as the rules do: taken
# from a time (`-`), added to an age (`+`), so a node whose clock is off reads right (docs/alerts.md, "Clock skew").
NODE_CLOCK_JOIN = f"on (instance, job) group_left () {rec.NODE_CLOCK_OFFSET}"


def age(stamped: str) -> str:
    """Seconds since `stamped`, a time the node stamped, on Prometheus' clock."""
    return f"time() - {stamped} + {NODE_CLOCK_JOIN}"

B = TypeVar("B", bound=cogbuilder.Builder)


@dataclass(frozen=True)
class Q:
    """One PromQL query of a panel; `table` queries are instant and formatted as a table,
    `buckets` ones are histogram buckets that Grafana de-accumulates for a heatmap."""

    expr: str
    legend: str = ""
    table: bool = False
    buckets: bool = False


def base_dashboard(
    title: str, uid: str, tags: list[str], description: str, *, since: str = "now-1h", refresh: str = "30s"
) -> dashboard.Dashboard:
    """The settings every stepscope dashboard shares, with the `datasource` variable first and a link set to the
    other stepscope dashboards (by tag), which keeps the time range and the variables."""
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .tags(tags)
        .description(description)
        .time(since, "now")
        .refresh(refresh)
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            dashboard.DashboardLink("stepscope")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(True)
            .keep_time(True)
            .include_vars(True)
        )
        .with_variable(datasource_variable())
    )


def data_link(title: str, uid: str, variable: str) -> list[dm.DynamicConfigValue]:
    """A table column's link to the dashboard `uid` with its `variable` set to the clicked value, keeping the
    time range and the data source, so a row leads to its run or node (the override's `links` property)."""
    url = f"/d/{uid}?var-{variable}=${{__value.raw}}&var-datasource=${{datasource}}&${{__url_time_range}}"
    return [dm.DynamicConfigValue(id_val="links", value=[{"title": title, "url": url}])]


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(
    name: str,
    label: str,
    metric_selector: str,
    label_name: str,
    *,
    multi: bool = False,
    description: str = "",
) -> dashboard.QueryVariable:
    """A `label_values(selector, label)` variable; multi ones add "All" as the regex `.*`."""
    query = f"label_values({metric_selector}, {label_name})"
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query)
        .definition(query)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NATURAL_ASC)
    )
    if multi:
        variable = (
            variable.multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        )
    return variable


def custom_variable(
    name: str, label: str, choices: dict[str, int], *, description: str = ""
) -> dashboard.CustomVariable:
    """A fixed list of `choices` (text -> value), the first one picked."""
    options = [dm.VariableOption(selected=index == 0, text=text, value=str(value))
               for index, (text, value) in enumerate(choices.items())]
    return (
        dashboard.CustomVariable(name)
        .label(label)
        .description(description)
        .values(",".join(f"{text} : {value}" for text, value in choices.items()))
        .options(options)
        .current(options[0])
    )


def _target(query: Q, ref_id: str) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(query.expr).ref_id(ref_id).datasource(DATASOURCE)
    if query.legend:
        target = target.legend_format(query.legend)
    if query.table:
        target = target.format(prom_models.PromQueryFormat.TABLE).instant()
    elif query.buckets:
        target = target.format(prom_models.PromQueryFormat.HEATMAP)
    return target


def _panel(
    builder: B, title: str, description: str, queries: Sequence[Q], unit: str | None, width: int, height: int
) -> B:
    builder = builder.title(title).description(description).datasource(DATASOURCE).span(width).height(height)
    if unit:
        builder = builder.unit(unit)
    for index, query in enumerate(queries):
        builder = builder.with_target(_target(query, REF_IDS[index]))
    return builder


def thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return (
        dashboard.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in steps])
    )


def value_text(mapping: dict[str, tuple[str, str]]) -> list[dm.ValueMapping]:
    """Value -> (text, colour) mappings, e.g. state codes to names."""
    return [
        dm.ValueMap(
            options={
                value: dm.ValueMappingResult(text=text, color=color, index=index)
                for index, (value, (text, color)) in enumerate(mapping.items())
            }
        )
    ]


def range_text(low: float, high: float, text: str, color: str) -> dm.ValueMapping:
    """Values in [low, high] shown as `text` in `color`: a hint in place of a number."""
    return dm.RangeMap(
        options=dm.DashboardRangeMapOptions(
            from_val=low, to=high, result=dm.ValueMappingResult(text=text, color=color, index=0)
        )
    )


def timeseries_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    unit: str,
    *,
    stack: bool = False,
    limits: tuple[float | None, float | None] = (None, None),
    threshold_line: dashboard.ThresholdsConfig | None = None,
    no_data: str = "",
    width: int = 12,
    height: int = 8,
) -> timeseries.Panel:
    """`no_data`: what the panel says in place of Grafana's "No data" (why a reading can be absent)."""
    panel = _panel(timeseries.Panel(), title, description, queries, unit, width, height)
    panel = (
        panel.legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM)
        )
        .tooltip(
            common.VizTooltipOptions()
            .mode(common_models.TooltipDisplayMode.MULTI)
            .sort(common_models.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(10)
    )
    if stack:
        panel = panel.stacking(common.StackingConfig().mode(common_models.StackingMode.NORMAL)).fill_opacity(
            60
        )
    low, high = limits
    if low is not None:
        panel = panel.min(low)
    if high is not None:
        panel = panel.max(high)
    if no_data:
        panel = panel.no_value(no_data)
    if threshold_line is not None:
        panel = panel.thresholds(threshold_line).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(common_models.GraphThresholdsStyleMode.DASHED)
        )
    return panel


def stat_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    unit: str,
    *,
    steps: dashboard.ThresholdsConfig | None = None,
    show_name: bool = False,
    sparkline: bool = True,
    mappings: list[dm.ValueMapping] | None = None,
    width: int = 4,
    height: int = 5,
) -> stat.Panel:
    """A stat of each query's last value; `sparkline=False` for figures of the whole time range, whose line would
    be flat (the same figure at every step)."""
    panel = _panel(stat.Panel(), title, description, queries, unit, width, height)
    panel = panel.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    if mappings:
        panel = panel.mappings(mappings)
    if show_name:
        panel = panel.text_mode(common_models.BigValueTextMode.NAME)
    if show_name or not sparkline:
        panel = panel.graph_mode(common_models.BigValueGraphMode.NONE)
    if steps is not None:
        panel = panel.thresholds(steps).color_mode(common_models.BigValueColorMode.BACKGROUND)
    return panel


def bargauge_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    unit: str,
    *,
    limits: tuple[float, float] = (0, 1),
    steps: dashboard.ThresholdsConfig | None = None,
    lowest_first: bool = False,
    width: int = 12,
    height: int = 8,
) -> bargauge.Panel:
    """A bar per series, in the order the series come (Prometheus' label order): a bar gauge has no sort of its
    own. `lowest_first`: the one query is an instant table, a bar per row (named by its labels), sorted by value
    lowest first, so the bar that matters is on top; every row gets its bar (BARS_AT_MOST)."""
    panel = _panel(bargauge.Panel(), title, description, queries, unit, width, height)
    panel = (
        panel.min(limits[0])
        .max(limits[1])
        .display_mode(common_models.BarGaugeDisplayMode.GRADIENT)
        .orientation(common_models.VizOrientation.HORIZONTAL)
    )
    if lowest_first:
        panel = panel.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(True).limit(BARS_AT_MOST))
        panel = panel.with_transformation(_sorted_by("Value", descending=False))
    else:
        panel = panel.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    if steps is not None:
        panel = panel.thresholds(steps)
    return panel


def _sorted_by(field: str, *, descending: bool) -> dm.DataTransformerConfig:
    """Grafana's sortBy transformation: the rows of a table ordered by `field`."""
    return dm.DataTransformerConfig(id_val="sortBy", options={"fields": {}, "sort": [{"field": field,
                                                                                      "desc": descending}]})


def table_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    columns: dict[str, tuple[str, str]],
    *,
    hide: Sequence[str] = ("Time", "__name__", "job"),
    sort_by: str = "",
    descending: bool = False,
    width: int = 24,
    height: int = 8,
) -> table.Panel:
    """Instant table queries merged on their labels; `columns` maps "Value #<ref>" -> (name, unit); `sort_by`
    names the column the rows are sorted by, lowest first, or highest first where `descending`: the row that
    matters on top, not wherever the labels put it."""
    panel = _panel(table.Panel(), title, description, queries, None, width, height)
    if sort_by:
        panel = panel.sort_by([common.TableSortByFieldState().display_name(sort_by).desc(descending)])
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    panel = panel.with_transformation(
        dm.DataTransformerConfig(
            id_val="organize",
            options={
                "excludeByName": {name: True for name in hide},
                "renameByName": {value: name for value, (name, _) in columns.items()},
            },
        )
    )
    for name, unit in columns.values():
        panel = panel.override_by_name(name, [dm.DynamicConfigValue(id_val="unit", value=unit)])
    return panel


def heatmap_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    unit: str,
    *,
    y_unit: str = "",
    width: int = 12,
    height: int = 8,
) -> heatmap.Panel:
    """A heatmap of pre-bucketed series (histogram buckets, or one row per series)."""
    panel = _panel(heatmap.Panel(), title, description, queries, None, width, height)
    panel = (
        panel.calculate(False)
        .cell_values(heatmap.CellValues().unit(unit))
        .y_axis(heatmap.YAxisConfig().unit(y_unit) if y_unit else heatmap.YAxisConfig())
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_models.HeatmapColorMode.SCHEME)
            .scheme("RdYlGn")
            .fill("dark-orange")
            .steps(64)
            .exponent(0.5)
            .reverse(False)
        )
    )
    return panel


def state_timeline_panel(
    title: str,
    description: str,
    queries: Sequence[Q],
    mappings: list[dm.ValueMapping],
    *,
    width: int = 24,
    height: int = 8,
) -> statetimeline.Panel:
    panel = _panel(statetimeline.Panel(), title, description, queries, None, width, height)
    return panel.mappings(mappings).show_value(common_models.VisibilityMode.NEVER).merge_values(True)


def alert_list_panel(title: str, description: str, *, width: int = 24, height: int = 6) -> dashboard.Panel:
    """Grafana's alert list (no query); shows the provisioned stepscope alert rules that fire."""
    return (
        dashboard.Panel()
        .type("alertlist")
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .options(
            {
                "viewMode": "list",
                "groupMode": "default",
                "groupBy": [],
                "maxItems": 20,
                "sortOrder": 1,
                "dashboardAlerts": False,
                "alertName": "",
                "folder": {"title": "stepscope"},
                "stateFilter": {
                    "firing": True,
                    "pending": True,
                    "normal": False,
                    "error": True,
                    "noData": False,
                },
                "alertInstanceLabelFilter": "",
            }
        )
    )


def row(title: str) -> dashboard.Row:
    return dashboard.Row(title)
