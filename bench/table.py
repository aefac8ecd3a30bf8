"""The benchmarks' output: one markdown table of the chosen columns, then every row as JSON."""
import json


def print_table(rows: list[dict], cols: list[str], fmt: dict | None = None, dump: bool = True):
    """`fmt`: a format spec per column ('.0f', '.1%'); other floats print with 2 decimals. `dump`: the
    rows as one JSON line after the table (what scripts and tests read back)."""
    fmt = fmt or {}
    cell = lambda r, c: format(r[c], fmt[c]) if c in fmt else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])  # noqa: E731
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(cell(r, c) for c in cols) + " |")
    if dump:
        print(json.dumps(rows))
