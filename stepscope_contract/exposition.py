"""How a label value is written in the text exposition format 0.0.4, for every writer of it.

The hooks render a push body, the exporter re-renders what it ingested and renders its own families on each
scrape: one escaper, so the three cannot drift apart (each had a copy). Prometheus reads back exactly three
escapes in a label value: backslash, double quote and line feed; anything else is written as it is.
"""


def escape_label_value(value: str) -> str:
    """`value` with backslash, line feed and double quote escaped, backslash first so no escape is escaped again.

    Nearly every value (a rank, a run, a phase, a GPU's index) has none of the three: three `in` scans return
    it as it is, faster than the chained replace for every length and than str.translate, which looks up each
    character (48-character pod name: 66 ns against 154 ns and 1,419 ns; timeit in the commit that added this).
    """
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value
