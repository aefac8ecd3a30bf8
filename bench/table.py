"""The benchmarks' output: one markdown table of the chosen columns, then every row as JSON."""
import json


def print_table(rows: list[dict], cols: list[str]):
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print(json.dumps(rows))
