#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
from collections import defaultdict
totals = defaultdict(float)
with open("data/transactions.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        totals[r["category"]] += float(r["amount"])
open("answer.txt", "w").write(max(totals, key=totals.get) + "\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
