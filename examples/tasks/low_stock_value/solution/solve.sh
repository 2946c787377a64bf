#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
total = 0.0
with open("data/inventory.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["warehouse"] == "WH-North" and int(r["qty"]) < int(r["reorder_level"]):
            total += int(r["qty"]) * float(r["unit_cost"])
open("answer.txt", "w").write(f"{total:.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
