#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
from dateutil import parser
total = 0.0
with open("data/invoices.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if not r["paid"].strip():
            continue
        gap = (parser.parse(r["paid"]) - parser.parse(r["issued"])).days
        if gap > 30:
            total += float(r["amount"])
open("answer.txt", "w").write(f"{total:.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
