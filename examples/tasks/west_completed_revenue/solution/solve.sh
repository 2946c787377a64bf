#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
total = 0.0
with open("data/sales.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["region"] == "West" and r["status"] == "completed":
            total += int(r["quantity"]) * float(r["unit_price"])
open("answer.txt", "w").write(f"{total:.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
